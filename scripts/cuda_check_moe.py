"""MoE routing replay on a CUDA machine: capture routing from vLLM for the tiny MoE model, replay it in the trainer's
forward, and print how often engine and trainer choose different experts with and without replay.

    .venv/bin/python scripts/cuda_check_moe.py [--model tiny-moe] [--dtype bfloat16]

Needs a GPU: vLLM returns routed experts only with its V2 model runner and Triton (CUDA). On a CPU machine it exits
with that message.
"""
import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import molt  # noqa: E402


async def main(args):
    import torch
    from transformers import AutoModelForCausalLM
    if not torch.cuda.is_available():
        sys.exit(molt.ROUTING_CPU_ERROR)
    cfg = molt.Config()
    cfg.data.max_len, cfg.train.routing_replay, cfg.engine.dtype = 1024, True, args.dtype
    cfg.engine.gpu_memory_utilization = 0.3
    path = molt.resolve_model(args.model)
    molt.ray_init(cfg)
    engine = molt.start_engines(cfg, path)[0]
    samples = []
    for i in range(8):
        [c] = await engine.generate.remote(molt.EngineRequest([5 + i, 6, 7, 8, 9], sampling={
            "max_tokens": 64, "temperature": 1.0}))
        s = molt.Sample(rollout_id=str(i))
        s.add_context([5 + i, 6, 7, 8, 9])
        s.add_turn(c)
        samples.append(s)
    captured = sum(int((s.routing >= 0).all(-1).all(-1).sum()) for s in samples)
    print(f"captured routing for {captured} of {sum(len(s.tokens) for s in samples)} tokens "
          f"(shape per sample [T, layers, top_k] = {list(samples[0].routing.shape)})")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).cuda()
    for replay in (False, True):
        routers = molt.prepare_moe(model, model.config, molt.ActorConfig(), "policy", replay=replay)
        mb = molt.collate(samples, list(range(len(samples))), None, torch.device("cuda"))
        with torch.no_grad():
            logits = molt.model_forward(model, mb, None)
        lp = molt.token_logprobs(logits, mb["ids"], 1.0)[0]
        gap = float(((lp - mb["behaviour"]).abs() * mb["mask"]).sum() / mb["mask"].sum())
        num = sum(float(r.molt_mismatch[0].sum()) for r in routers)
        den = sum(float(r.molt_mismatch[1].sum()) for r in routers)
        chosen = sum(float((r.molt_selected != r.molt_target).any(-1)[(r.molt_target >= 0).all(-1)].sum())
                     for r in routers)
        print(f"replay {'on ' if replay else 'off'}: engine-vs-trainer live routing mismatch {num / den:.4f} of "
              f"(token, layer) selections; selections differing from the engine's after replay: {chosen:.0f}; "
              f"mean |log p_train - log p_engine| {gap:.5f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--dtype", default="bfloat16")
    asyncio.run(main(p.parse_args()))
