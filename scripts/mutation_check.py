"""Do the tests bite? Applies targeted mutations of molt.py one at a time to a scratch copy of the repository, runs only
the tests that must catch each, and prints caught / missed and the score. Not part of CI (it takes ~35 minutes here);
run it before finishing any change to a core section, keep the score at 100 %, and add a mutation whenever a bug is
fixed.

    .venv/bin/python scripts/mutation_check.py                 # every mutation
    .venv/bin/python scripts/mutation_check.py --only staleness --list

Each mutation is (name, the invariant it breaks, the exact text, its replacement, the tests that must fail[, the file:
molt.py unless named]). A pattern that no longer occurs exactly once is reported as stale: update the list with the
code.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AG, EN, TR, AL, RO, MO, CF, FA, SE = ("tests/test_agents.py", "tests/test_engines.py", "tests/test_trainer.py",
                                      "tests/test_algorithms.py", "tests/test_rollout.py", "tests/test_moe.py",
                                      "tests/test_config.py", "tests/test_faults.py", "tests/test_security.py")
SF, SFT, SV, FM = "tests/test_server_fuzz.py", "tests/test_sft.py", "tests/test_server.py", "tests/test_families.py"
SANDBOX, GRADER, CODE = "rewards/sandbox.py", "rewards/math_grader.py", "rewards/code_grader.py"
JUDGE, GEO = "agents/judge.py", "agents/chat_geo3k.py"
RS, EV = "tests/test_responses.py", "tests/test_envs.py"

MUTATIONS = [
    # -- token identity: the sampled ids are the trajectory --------------------------------------------------------
    ("env-retokenize", "token identity: the engine is prompted with re-tokenized text instead of the sampled ids",
     "req = EngineRequest(sample.tokens, sample.images",
     "req = EngineRequest(self.codec.tokenizer(self.codec.tokenizer.decode(sample.tokens), "
     "add_special_tokens=False)['input_ids'], sample.images",
     [f"{AG}::test_env_engine_input_is_the_rendered_conversation_with_the_sampled_ids"]),
    ("env-closing", "token identity: the template's end-of-turn text after a sampled action is dropped",
     "return self.closing(action_ids) + full[len(self.probe_base):]", "return full[len(self.probe_base):]",
     [f"{AG}::test_env_engine_input_is_the_rendered_conversation_with_the_sampled_ids"]),
    ("chat-closing", "token identity: the chat path drops the end-of-turn text between turns",
     "return self.codec.closing(seg.tokens) + new, images", "return new, images",
     [f"{AG}::test_multi_turn_chat_is_one_token_exact_segment"]),
    ("chat-retokenize", "token identity: the chat path re-tokenizes the session's text",
     "context = (seg.tokens if seg else []) + ids",
     "context = self.codec.encode(self.codec.tokenizer.decode((seg.tokens if seg else []) + ids))[0]",
     [f"{AG}::test_multi_turn_chat_is_one_token_exact_segment"]),
    ("context-trainable", "token identity: context tokens are marked trainable",
     "self.mask += [int(sampled)] * len(ids)", "self.mask += [1] * len(ids)",
     [f"{AG}::test_env_engine_input_is_the_rendered_conversation_with_the_sampled_ids"]),
    ("history-check", "segments: an edited history is treated as a continuation",
     "msgs[:n] != last and (last is None or", "False and (last is None or",
     [f"{AG}::test_a_rewritten_history_opens_a_token_exact_segment"]),
    # -- policy versions and staleness -----------------------------------------------------------------------------
    ("rollout-close-cancels-nothing", "async state: the run's end leaves its groups in flight (one finishing after "
     "Ray's shutdown ends the run with status 1)",
     "        tasks = list(self.tasks)\n        for task in tasks:", "        tasks = []\n        for task in tasks:",
     [f"{RO}::test_closing_cancels_the_groups_in_flight_and_issues_no_more"]),
    ("turn-versions", "versions: a Sample drops the engine's per-token versions",
     "self.extend(c.ids, c.logprobs, c.versions, c.temperature)",
     "self.extend(c.ids, c.logprobs, [0] * len(c.ids), c.temperature)",
     [f"{RO}::test_staleness_exactly_at_the_bound_is_kept_and_one_past_is_dropped"]),
    ("resume-version", "versions: an engine labels tokens after an update with the previous version",
     "await self.set_version(version)", "await self.set_version(version - 1)",
     [f"{EN}::test_update_mid_request_switches_versions_exactly"]),
    ("staleness-off-by-one", "staleness: a group exactly at the bound is dropped",
     "<= ro.max_staleness]", "< ro.max_staleness]",
     [f"{RO}::test_staleness_exactly_at_the_bound_is_kept_and_one_past_is_dropped"]),
    ("staleness-newest", "staleness: a partial rollout is as old as its newest token, not its oldest",
     "return min((v for v, m in zip(s.versions, s.mask) if m), default=-1)",
     "return max((v for v, m in zip(s.versions, s.mask) if m), default=-1)",
     [f"{RO}::test_a_partial_rollout_is_as_stale_as_its_oldest_trained_token"]),
    # -- forward consistency ---------------------------------------------------------------------------------------
    ("engine-raw-logprobs", "forward consistency: engine log-probs taken before temperature scaling",
     'logprobs_mode="processed_logprobs"', 'logprobs_mode="raw_logprobs"',
     [f"{EN}::test_logprobs_align_and_match_the_trainer_at_the_sampling_temperature"]),
    ("trainer-temperature", "forward consistency: the trainer ignores the sampling temperature",
     "logp = (logits / temperature).log_softmax(-1)", "logp = logits.log_softmax(-1)",
     [f"{EN}::test_logprobs_align_and_match_the_trainer_at_the_sampling_temperature"]),
    ("tied-lm-head", "forward consistency: a tied lm_head keeps the engine's stale packed weights after a sync",
     'if tied and name.endswith("lm_head"):', 'if False and name.endswith("lm_head"):',
     [f"{TR}::test_synced_engine_matches_the_trainer"]),
    ("chunk-temperature", "forward consistency: every chunk of the log-prob head takes the first chunk's temperatures",
     "t = temp if isinstance(temp, (int, float)) else temp[i:i + rows]",
     "t = temp if isinstance(temp, (int, float)) else temp[:rows]",
     [f"{TR}::test_chunked_logprobs_equal_the_whole_logits_and_never_hold_them"]),
    ("chunk-kept", "memory: the chunked log-prob head keeps every chunk's logits for backward",
     "recompute = torch.is_grad_enabled() and len(x) > rows", "recompute = False",
     [f"{TR}::test_chunked_logprobs_equal_the_whole_logits_and_never_hold_them"]),
    ("bare-copies", "forward consistency: a gpt-oss weight update leaves the sinks and experts at their old values",
     'BARE_COPIES = {"GptOssForCausalLM": {"sinks", "w13_weight"}}', 'BARE_COPIES = {"GptOssForCausalLM": set()}',
     [f"{FM}::test_a_tool_agent_trains_then_syncs_on_each_family[gpt-oss]"]),
    ("bare-copies-sinks", "forward consistency: a gpt-oss weight update leaves the attention sinks at their old values",
     'BARE_COPIES = {"GptOssForCausalLM": {"sinks", "w13_weight"}}', 'BARE_COPIES = {"GptOssForCausalLM": {"w13_weight"}}',
     [f"{FM}::test_a_tool_agent_trains_then_syncs_on_each_family[gpt-oss]"]),
    ("routing-last-writer", "routing replay: a later turn overwrites the routing recorded when a position was sampled",
     "unset = (self.routing[:k] < 0).all(axis=(1, 2))", "unset = np.ones(k, dtype=bool)",
     [f"{MO}::test_sample_routing_is_stored_by_position_and_the_first_writer_wins"]),
    # -- advantages and losses -------------------------------------------------------------------------------------
    ("segments-as-rollouts", "advantages: each segment of an episode counts as its own rollout",
     'rollout_keys = [s.rollout_id or f"#{i}" for i, s in enumerate(samples)]',
     'rollout_keys = [f"{s.rollout_id}/{s.segment}" for i, s in enumerate(samples)]',
     [f"{TR}::test_segments_of_one_episode_share_its_advantage_through_learn"]),
    ("idless-one-group", "advantages: samples without ids all fall into one group",
     'ids.setdefault(("g", s.group_id or r), len(ids))', 'ids.setdefault(("g", s.group_id), len(ids))',
     [f"{AL}::test_samples_without_ids_are_separate_episodes_and_groups"]),
    ("grpo-biased-std", "advantages: GRPO normalises by the biased standard deviation",
     "(sq / (n - 1).clamp(min=1)).sqrt()", "(sq / n).sqrt()",
     [f"{AL}::test_grpo_normalises_within_groups_with_unbiased_std"]),
    ("rloo-includes-self", "advantages: the leave-one-out baseline includes the rollout itself",
     'b["r"] - (mean * n - b["r"]) / (n - 1).clamp(min=1)', 'b["r"] - mean',
     [f"{AL}::test_dr_grpo_and_rloo"]),
    ("gae-no-gamma", "advantages: GAE forgets the discount in its recursion",
     "algo.gamma * algo.lam * running", "algo.lam * running",
     [f"{AL}::test_gae_matches_hand_computation_and_monte_carlo_at_lambda_one"]),
    ("reward-clip", "advantages: rewards are not clipped",
     "reward = reward.clamp(-algo.reward_clip, algo.reward_clip)", "reward = reward",
     [f"{AL}::test_rewards_are_clipped_before_the_estimator"]),
    ("ppo-max", "loss: PPO takes the optimistic side of the clip",
     "loss = -torch.minimum(s1, s2)", "loss = -torch.maximum(s1, s2)", [f"{AL}::test_ppo_clip_and_dual_clip"]),
    ("cispo-attached", "loss: CISPO's weight carries gradient",
     "-ratio.clamp(max=algo.clip_high).detach() * adv", "-ratio.clamp(max=algo.clip_high) * adv",
     [f"{AL}::test_cispo_clips_detached_weight_from_above_only"]),
    ("token-mean-local", "loss: token-mean over the micro-batch instead of the whole batch",
     "return loss.sum() / max(n_tokens, 1.0)", "return loss.sum() / max(float(mask.sum()), 1.0)",
     [f"{TR}::test_one_rank_and_two_ranks_take_the_same_step"]),
    ("kl-twice", "loss: the KL is also put in the loss when it already shapes the reward",
     "return algo.kl_coef > 0 and not algo.kl_in_reward and not", "return algo.kl_coef > 0 and not",
     [f"{CF}::test_estimator_traits_decide_what_a_run_needs"]),
    ("longest-last-segment", "DAPO overlong: an episode's longest reply is taken from its last segment only",
     "longest[key] = max(longest.get(key, 0), max(map(len, runs)))", "longest[key] = max(map(len, runs))",
     [f"{AL}::test_the_longest_reply_may_sit_in_any_segment_and_only_the_last_reply_is_judged_cut"]),
    ("cut-first-reply", "ProRL stop penalty: judged on an episode's first segment instead of its last reply",
     "last[key] = s  # segments come in order", "last.setdefault(key, s)  # segments come in order",
     [f"{AL}::test_the_longest_reply_may_sit_in_any_segment_and_only_the_last_reply_is_judged_cut"]),
    # -- off-policy correction -------------------------------------------------------------------------------------
    ("geo-unmasked", "IS correction: the geometric mean counts a padded sample's padding",
     "torch.exp(masked_mean(lr, mask, dim=1))", "torch.exp(lr.mean(1))",
     [f"{AL}::test_a_padded_sample_loses_and_weighs_as_it_does_alone"]),
    ("is-unmasked", "IS correction: log-ratios of padding enter the sequence ratio",
     "lr = log_ratio(old, behaviour) * mask", "lr = log_ratio(old, behaviour)",
     [f"{AL}::test_a_padded_sample_loses_and_weighs_as_it_does_alone"]),
    ("trunc-as-clip", "IS correction: truncation also raises ratios below the band",
     "return u.clamp(max=hi), (u > hi).float()", "return u.clamp(lo, hi), ((u < lo) | (u > hi)).float()",
     [f"{AL}::test_is_modes_differ_below_the_band"]),
    ("seq-mean", "IS correction: the sequence ratio uses the mean log-ratio, not the sum",
     "torch.exp(lr.sum(1).clamp(", "torch.exp(lr.mean(1).clamp(", [f"{AL}::test_is_levels_and_modes"]),
    ("mask-keeps-u", "IS correction: mask mode weights kept tokens by the gate ratio instead of their own",
     "return torch.where(keep, w, torch.zeros_like(w))", "return torch.where(keep, u, torch.zeros_like(w))",
     [f"{AL}::test_is_levels_and_modes"]),
    # -- rollout, router, filtering --------------------------------------------------------------------------------
    ("filter-inclusive", "filtering: groups with all-equal scores at the band's edge are kept",
     "if not lo_hi[0] < sum(scores.values()) / len(scores) < lo_hi[1]:",
     "if not lo_hi[0] <= sum(scores.values()) / len(scores) <= lo_hi[1]:",
     [f"{RO}::test_groups_outside_the_filter_range_are_dropped_and_counted"]),
    ("coalesce-same-sample", "router: the members of a coalesced group all get the first sample",
     "[[c] for c in out]", "[[out[0]] for c in out]",
     [f"{EN}::test_router_coalesces_a_prompt_group_into_one_request"]),
    ("router-no-affinity", "router: later turns of a rollout may go to another engine (prefix cache lost)",
     "i = self.sticky.get(key)", "i = None", [f"{EN}::test_router_affinity_and_spread"]),
    # -- resume ----------------------------------------------------------------------------------------------------
    ("resume-no-scheduler", "resume: the LR scheduler restarts instead of resuming",
     'self.sched.load_state_dict(state["sched"])', "pass",
     [f"{TR}::test_checkpoint_resume_continues_weights_optimizer_and_schedule_exactly"]),
    ("resume-no-optimizer", "resume: the optimizer state is not restored",
     "set_optimizer_state_dict(self.model, self.optim, state[\"optim\"],",
     "(lambda *a, **k: None)(self.model, self.optim, state[\"optim\"],",
     [f"{TR}::test_checkpoint_resume_continues_weights_optimizer_and_schedule_exactly"]),
    ("resume-null-cursor", "resume: the data cursor is saved as null",
     '"cursor": self.cursor, "unfinished"', '"cursor": None, "unfinished"',
     [f"{RO}::test_the_data_cursor_survives_a_checkpoint_in_order"]),
    ("resume-tmp-checkpoint", "resume: a half-written checkpoint directory is taken as the newest",
     'if (p / "molt_state.json").exists()]', 'if p.is_dir()]',
     [f"{TR}::test_checkpoint_resume_continues_weights_optimizer_and_schedule_exactly"]),
    ("resume-drops-finished", "resume: finished groups waiting to be trained are not checkpointed",
     '"finished": list(self.finished), "counts"', '"finished": [], "counts"',
     [f"{RO}::test_async_state_holds_finished_groups_and_prompts_in_flight_and_restores_them"]),
    ("resume-drops-in-flight", "resume: prompts in flight at the checkpoint are never re-issued",
     '"unfinished": self.pending + list(self.tasks.values())', '"unfinished": self.pending',
     [f"{RO}::test_async_state_holds_finished_groups_and_prompts_in_flight_and_restores_them"]),
    ("resume-unchecked", "resume: a different model, estimator or data set resumes silently",
     "    if refused and not cfg.force:", "    if False:",
     [f"{FA}::test_resume_refuses_a_different_experiment_and_finds_the_newest_run"]),
    ("resume-no-cut-back", "resume: the steps a killed run logged after its checkpoint appear twice",
     "    cut_back(root, step)\n", "", [f"{FA}::test_sync_run_killed_at_three_points_resumes_exactly"]),
    # -- real families (#32) ---------------------------------------------------------------------------------------
    ("guided-trained", "forward consistency: tokens sampled under a grammar train with grammar-masked log-probs",
     "if c.temperature > 0 and not c.guided:", "if c.temperature > 0:",
     [f"{SV}::test_guided_tokens_stay_context_and_every_trained_token_matches_the_trainer"]),
    ("string-content-lists", "families: list content reaches a template that concatenates strings",
     'c = "\\n".join(p["text"] for p in c) if string else c', "c = c",
     [f"{FM}::test_content_blocks_reach_a_string_template_as_text"]),
    ("template-rerender-cut", "token identity: a template that re-renders earlier turns is cut at the old length",
     "if seg is not None and full.startswith(prefix) and prefix", "if seg is not None and prefix",
     [f"{FM}::test_a_template_that_rewrites_an_earlier_turn_opens_a_new_segment_unless_history_appends"]),
    ("history-append-ignored", "segments: --server.history append still opens a new segment where the template "
     "rewrites an earlier turn", 'elif seg is not None and (self.cfg.server.history == "append" or', "elif False and (",
     [f"{FM}::test_a_template_that_rewrites_an_earlier_turn_opens_a_new_segment_unless_history_appends"]),
    ("responses-chain-rerendered", "segments: a previous_response_id chain opens a new segment where the template "
     "rewrites an earlier turn", ' or turn.echo.get("previous_response_id")):', "):",
     [f"{FM}::test_reasoning_is_a_reasoning_item_on_the_responses_wire_and_a_chain_keeps_its_tokens"]),
    ("cut-call-completed", "wire: a call cut at max_tokens is reported as a finished call (tool_calls, completed)",
     'finish = "length" if c.finish_reason == "length" else "tool_calls" if calls else "stop"',
     'finish = "tool_calls" if calls else "length" if c.finish_reason == "length" else "stop"',
     [f"{FM}::test_a_call_cut_at_max_tokens_is_cut_on_every_wire"]),
    ("info-trained-only", "metrics: agents' info metrics average over the trained episodes only (an episode dropped "
     "for having no action token, a forced call that never parsed, is invisible)",
     "infos = list(infos) or list({s.rollout_id: s.info for s in samples}.values())",
     "infos = list({s.rollout_id: s.info for s in samples}.values())",
     [f"{RO}::test_agent_metrics_count_every_finished_episode_not_only_the_trained"]),
    ("forced-added-tokens", "families: a forced call may sample added tokens inside its guided JSON (</tool_call> "
     "cuts a hermes call)", "self.avoided = {i: -100 for i in added.values() if i not in ends}",
     "self.avoided = {i: -100 for i in added.values() if i not in ends and i in ()}",
     [f"{FM}::test_a_forced_call_can_sample_no_added_token_but_the_stop_that_ends_it"]),
    ("lora-request-dropped", "forward consistency: with LoRA the engine samples the base, not the adapter",
     "lora_request=self.lora):", "lora_request=None):",
     ["tests/test_lora.py::test_requests_wait_for_the_first_adapter_then_sample_through_it",
      "tests/test_lora.py::test_an_adapter_sync_mid_request_switches_versions_exactly"]),
    ("lora-no-first-adapter-wait", "versions: with LoRA a request samples the bare base before the first adapter "
     "arrives", "if not cfg.train.lora_rank:  # with LoRA, requests wait", "if True:  # with LoRA, requests wait",
     ["tests/test_lora.py::test_requests_wait_for_the_first_adapter_then_sample_through_it"]),
    ("lora-not-in-place", "versions: an adapter update is not loaded in place (vLLM keeps the adapter it cached for "
     "the id)", 'LoRARequest("policy", 1, str(folder), load_inplace=True)',
     'LoRARequest("policy", 1, str(folder), load_inplace=False)',
     ["tests/test_lora.py::test_an_adapter_sync_mid_request_switches_versions_exactly"]),
    ("lora-merge-unscaled", "checkpoints: merge-on-save adds B @ A without alpha / r",
     'scale = config["lora_alpha"] / config["r"]', "scale = 1.0",
     ["tests/test_lora.py::test_merged_state_is_the_adapted_model"]),
    ("prompt-agg-token-mean", "algorithms: --algo.loss-agg prompt is the token-mean",
     "w = 1.0 / (len(tokens) * max(tokens[samples[i].group_id], 1))", "w = 1.0 / sum(tokens.values())",
     [f"{AL}::test_prompt_mean_token_mean_is_the_mean_over_prompts_of_their_token_means"]),
    ("stop-penalty-ignored", "algorithms: an episode cut off without a stop keeps its reward",
     'r *= algo.stop_penalty if last[key].finish_reason == "length" else 1.0', "r *= 1.0",
     [f"{AL}::test_length_penalties_by_hand"]),
    ("envs-load-data-ignored", "environments: a module's load_data is bypassed and --data read as a file",
     'load = getattr(import_path(cfg.agent), "load_data", None) if cfg and cfg.agent else None', "load = None",
     ["tests/test_envs.py::test_env_options_are_checked_at_launch"]),
    ("envs-rg-unextracted", "environments: reasoning-gym scores the whole reply, not its <answer>",
     "out = await molt.offload(score, self.label[\"task\"], answer, self.label)",
     "out = await molt.offload(score, self.label[\"task\"], action, self.label)",
     ["tests/test_envs.py::test_reasoning_gym_rows_are_the_librarys_and_its_score_is_the_reward"],
     "agents/reasoning_gym.py"),
    ("envs-vf-first-reward-only", "environments: a verifiers reward is its first component, not the weighted sum",
     "return Result(reward=trace.reward,", "return Result(reward=next(iter(trace.rewards.values())).score,",
     ["tests/test_envs.py::test_verifiers_single_turn_env_its_rubric_is_the_reward"], "agents/verifiers_env.py"),
    ("envs-ta-policy-side-wrong", "environments: the reward is the opponent's outcome",
     "reward, mine = float(rewards[self.me]), info.get(self.me, {})",
     "reward, mine = float(rewards[1 - self.me if len(rewards) > 1 else self.me]), info.get(self.me, {})",
     ["tests/test_envs.py::test_textarena_games_end_with_the_librarys_outcome"], "agents/textarena_env.py"),
    ("envs-vf-client-kept", "environments: every verifiers episode leaves its session's HTTP client behind",
     "            await drop_client(env, client)\n", "",
     ["tests/test_envs.py::test_verifiers_single_turn_env_its_rubric_is_the_reward"], "agents/verifiers_env.py"),
    ("envs-rg-json-entry", "environments: reasoning-gym scores a JSON copy of the entry (tuples become lists)",
     'entry = pickle.loads(base64.b64decode(req["entry"]))',
     'import json; entry = json.loads(json.dumps(pickle.loads(base64.b64decode(req["entry"]))))',
     [f"{EV}::test_every_reasoning_gym_task_scores_its_gold_answer_as_the_library_does"], "agents/reasoning_gym.py"),
    ("envs-rg-unscreened", "trust: reasoning-gym answers reach the evaluating scorers as code",
     "task in EVALUATES and not is_data(answer)", "False",
     [f"{SE}::test_a_reasoning_gym_answer_never_runs_on_the_host",
      f"{SE}::test_a_reasoning_gym_answer_cannot_change_a_later_score_or_write_its_own"], "agents/reasoning_gym.py"),
    ("envs-rg-puzzle24-any-numbers", "environments: puzzle24 takes any four numbers that make 24",
     'INVARIANTS = {"puzzle24": uses_the_puzzles_numbers}', "INVARIANTS = {}",
     [f"{SE}::test_puzzle24_answers_must_use_the_puzzles_numbers"], "agents/reasoning_gym.py"),
    ("envs-rg-extract-first", "environments: reasoning-gym's answer is the first <answer>, not the last",
     "found, pos = (start + 8, end), end + 9", "found, pos = found or (start + 8, end), end + 9",
     ["tests/test_envs.py::test_reasoning_gym_rows_are_the_librarys_and_its_score_is_the_reward"],
     "agents/reasoning_gym.py"),
    ("envs-vf-children-inherit", "trust: verifiers' harness programs and tool servers inherit the trainer's secrets",
     '"environ": {k: os.environ[k] for k in CHILD_ENV', '"environ": {k: os.environ[k] for k in os.environ',
     [f"{SE}::test_verifiers_children_get_none_of_the_trainers_secrets"], "agents/verifiers_env.py"),
    ("envs-vf-host-harness", "trust: verifiers' bash harness runs the policy's commands on the host",
     'not in HOST_HARNESSES:', 'not in HOST_HARNESSES | {"bash"}:',
     [f"{EV}::test_env_options_are_checked_at_launch"], "agents/verifiers_env.py"),
    ("envs-ta-whole-action", "availability: a TextArena game reads the whole action (a quadratic move regex)",
     "action[-ACTION_CHARS:])", "action)",
     [f"{SE}::test_a_long_action_cannot_stall_the_pool"], "agents/textarena_env.py"),
    ("envs-ta-nim-overdraw", "environments: the opponent may take more from a Nim pile than it holds",
     "for q in range(1, n + 1)]", "for q in range(1, n + 2)]",
     [f"{EV}::test_every_two_player_game_plays_both_seats_against_the_default_opponent"], "agents/textarena_env.py"),
    ("lora-predictable-folder", "trust: the LoRA adapter folder is a predictable name made with exist_ok",
     'folder = Path(self.lora.lora_path) if self.lora else Path(tempfile.mkdtemp(  # (freed with the buffers)\n'
     '            prefix=f"molt-weights-{os.getpid()}-lora-{self.index}-", dir=shm_dir()))',
     'folder = shm_dir() / f"molt-weights-{os.getpid()}-lora-{self.index}"\n        folder.mkdir(exist_ok=True)',
     ["tests/test_lora.py::test_requests_wait_for_the_first_adapter_then_sample_through_it",
      "tests/test_lora.py::test_the_adapter_folder_is_private_and_never_a_link_someone_else_made"]),
    ("sweep-any-name", "trust: a stray molt-weights-x makes the stale-buffer sweep raise",
     "if pid.isdigit() and st.st_uid", "if int(pid) and st.st_uid",
     [f"{SE}::test_the_weight_sweep_removes_only_what_a_dead_run_of_this_user_left"]),
    ("sweep-any-owner", "trust: the stale-buffer sweep removes another user's files",
     "and st.st_uid == os.getuid() and", "and",
     [f"{SE}::test_the_weight_sweep_removes_only_what_a_dead_run_of_this_user_left"]),
    ("sandbox-writable-root", "trust: bwrap's root tmpfs stays writable, past the scratch cap",
     'argv += ["--remount-ro", "/"]', "argv += []",
     [f"{SE}::test_nothing_can_be_written_outside_the_scratch"], SANDBOX),
    ("sandbox-flock", "trust: a sandbox may flock a bound file, which the host sees",
     '"inotify_add_watch", "flock", ', '"inotify_add_watch", ',
     [f"{SE}::test_a_sandbox_cannot_hold_a_lock_the_host_sees"], SANDBOX),
    ("sandbox-fcntl-locks", "trust: a sandbox may take fcntl record locks on a bound file",
     "FILE_LOCKS = (5, 6, 7, 36, 37, 38, 1024)", "FILE_LOCKS = ()",
     [f"{SE}::test_a_sandbox_cannot_hold_a_lock_the_host_sees"], SANDBOX),
    ("sandbox-aio", "trust: a sandbox may take the host-wide AIO count",
     '"io_setup", ', "", [f"{SE}::test_a_sandbox_takes_nothing_from_the_hosts_aio_count_and_watches_nothing"],
     SANDBOX),
    ("sandbox-inotify", "trust: a sandbox may watch the bound directories with inotify",
     '"inotify_init", "inotify_init1",', "",
     [f"{SE}::test_a_sandbox_takes_nothing_from_the_hosts_aio_count_and_watches_nothing"], SANDBOX),
    ("sandbox-one-uid", "trust: every sandbox is one host uid, sharing the kernel's per-user budgets",
     "functools.partial(_enter, cgroups, roots, limits, w, side, uid)",
     "functools.partial(_enter, cgroups, roots, limits, w, side, SANDBOX_UID)",
     [f"{SE}::test_one_sandbox_cannot_spend_anothers_kernel_budgets"], SANDBOX),
    ("responses-metadata-unbounded", "availability: a stored response keeps metadata of any size",
     "_require(meta is None or isinstance(meta, dict) and len(meta) <= 16 and all(",
     "_require(True or isinstance(meta, dict) and len(meta) <= 16 and all(",
     [f"{RS}::test_a_sessions_stored_responses_and_segments_are_bounded"]),
    ("responses-bytes-unbounded", "availability: a session's stored responses have no byte budget",
     "while len(s.responses) > RESPONSES_KEPT or sum(", "while len(s.responses) > RESPONSES_KEPT or 0 * sum(",
     [f"{RS}::test_a_sessions_stored_responses_and_segments_are_bounded"]),
    ("session-segments-unbounded", "availability: a session may open any number of segments",
     "<= SESSION_SEGMENTS, f\"this episode", "<= 10 ** 9, f\"this episode",
     [f"{RS}::test_a_sessions_stored_responses_and_segments_are_bounded"]),
    ("grader-rounds-floats", "rewards: the sandboxed path rounds decimals (1.4142136 is sqrt 2), the host's does not",
     "verify(exact(gold), exact(answer), timeout_seconds=None)", "verify(gold, answer, timeout_seconds=None)",
     [f"{SE}::test_units_and_equations_are_read_as_written"], GRADER),
    ("grader-relation-by-spelling", "rewards: a relation spelled \\equiv or \u2250 passes for a value",
     "if not gold or not answer or relation(answer) and not relation(gold):", "if not gold or not answer:",
     [f"{SE}::test_units_and_equations_are_read_as_written"], GRADER),
    ("codec-special-only", "trust: an added token that is not special (Qwen3's <tool_call>, <think>) stays whole in "
     "content", "added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()}",
     "added = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}",
     [f"{SE}::test_special_token_spellings_in_content_stay_text"]),
    ("codec-template-on-shared", "token identity: a --chat-template is set on the tokenizer a model's other Codecs "
     "share (they render with it)",
     "        self.tokenizer, self.processor = load_tokenizer(model_path, chat_template and Path(chat_template).read_text())",
     "        self.tokenizer, self.processor = load_tokenizer(model_path)\n"
     "        self.tokenizer.chat_template = Path(chat_template).read_text() if chat_template else "
     "self.tokenizer.chat_template",
     [f"{AG}::test_codecs_of_one_model_share_its_tokenizer_but_not_a_chat_template"]),
    ("codec-rejoined-at-marks", "trust: content re-tokenized with its marks removed (a non-special added token "
     "re-forms)", "parts = [p.split(MARK) for p in pieces]", 'parts = [[p.replace(MARK, "")] for p in pieces]',
     [f"{SE}::test_special_token_spellings_in_content_stay_text"]),
    ("grader-side-64mib", "availability: a code grade's side channel takes 64 MiB whatever its parts need",
     "side=len(parts) * (VALUE_BYTES + 1))", "side=True)",
     [f"{SE}::test_a_solution_sends_back_no_more_than_its_parts_need"], CODE),
    ("grader-names-by-use", "rewards: a name the solution binds out of sight (exec, globals().update) is taken for its",
     "known = top_level_names(code) | problem.entries", "known = set().union(*(t.names for t in problem.tests))",
     [f"{SE}::test_a_name_the_solution_binds_out_of_sight_is_nobodys"], CODE),
    ("grader-chain-whole", "rewards: a chain past the solution's call runs whole where the solution runs",
     'sent = [(part, "_molt_x") if root in classes else', 'sent = [(part, "_molt_x") if True else',
     [f"{SE}::test_the_split_keeps_the_comparison_and_the_set_up_from_the_solution"], CODE),
    ("grader-setup-with-solution", "rewards: the test's set-up (oracles, expected data) runs in the solution's namespace",
     'request = {"code": code, "modules"', 'request = {"code": problem.setup + "\\n" + code, "modules"',
     [f"{SE}::test_the_split_keeps_the_comparison_and_the_set_up_from_the_solution"], CODE),
    ("envs-rg-eval-is-train", "environments: reasoning-gym's evaluation rows are its training rows",
     'seed = args.get("seed", cfg.seed) + evaluation', 'seed = args.get("seed", cfg.seed)',
     ["tests/test_envs.py::test_reasoning_gym_rows_are_the_librarys_and_its_score_is_the_reward"],
     "agents/reasoning_gym.py"),
    ("responses-chain-last-turn-only", "segments: a previous_response_id chain extends only the session's last turn "
     "(after another request it re-renders from text)", 'if rid := turn.echo.get("previous_response_id"):  # the stored',
     'if False and (rid := turn.echo.get("previous_response_id")):  # the stored',
     ["tests/test_responses.py::test_a_chain_continues_its_own_response_whatever_came_between"]),
    ("responses-chain-drops-output", "state: previous_response_id restores the earlier input but not the reply",
     'history = prev.echo["history"] + response_messages(response_output(reply, rid), "previous output")',
     'history = prev.echo["history"]',
     ["tests/test_responses.py::test_a_chain_of_responses_is_one_segment_streamed_or_not_and_kept_per_session"]),
    ("reasoning-not-compared", "token identity: a reply sent back with its reasoning edited extends the segment",
     'return (text or "").rstrip(), tuple(calls), (message.get("reasoning") or "").strip()',
     'return (text or "").rstrip(), tuple(calls), ""', [f"{FM}::test_an_edited_reasoning_is_an_edited_reply"]),
    ("reasoning-in-content", "wires: the reasoning parser is never used (reasoning stays in the text)",
     "return self.reasoning != \"none\" or (", "return False and (",
     [f"{FM}::test_reasoning_comes_apart_on_both_wires_streamed_or_not_and_goes_back_to_the_template"]),
    ("mistral-forced-format", "families: a forced call on Mistral left to vLLM's parser, which has no tag for it (a 400)",
     'CALL_TAGS = {"mistral": ("[TOOL_CALLS]{name}[ARGS]", ""),', "CALL_TAGS = {",
     [f"{FM}::test_a_tool_episode_as_agent_code_for_a_real_model_writes_it"]),
    ("answered-analysis", "segments: gpt-oss's template drops a call's analysis once the turn is answered, and the "
     "segment still extends in --server.history template", "prefix.startswith(before)", "True",
     [f"{FM}::test_check_template_reports_what_the_server_would_do_with_the_familys_template"]),
    ("gpt-oss-call-header", "families: a forced gpt-oss call left to vLLM's harmony tag (an analysis may come first; "
     "headers the template does not write back)", '"openai": (" to=functions.{name}<|channel|>commentary json'
     '<|message|>", "")}', "}", [f"{FM}::test_a_tool_episode_as_agent_code_for_a_real_model_writes_it"]),
    ("closing-after-stop", "token identity: the template's end of turn (<|end|>) is added after gpt-oss's own "
     "<|call|>", "if tokens and tokens[-1] in self.stop_ids and", "if False and",
     [f"{FM}::test_a_tool_episode_as_agent_code_for_a_real_model_writes_it"]),
    ("xgrammar-cache", "forward consistency: engines keep xgrammar's compile cache, which guides a token another grammar chose",
     '    os.environ.setdefault("VLLM_XGRAMMAR_CACHE_MB", "0")', "    pass",
     [f"{FM}::test_a_tool_episode_as_agent_code_for_a_real_model_writes_it",
      f"{FM}::test_reasoning_comes_apart_on_both_wires_streamed_or_not_and_goes_back_to_the_template"]),
    ("router-bias", "forward consistency: the trainer's router forward drops gpt-oss's router bias",
     'getattr(self, "bias", None)  # gpt-oss', 'None  # gpt-oss',
     ["tests/test_moe.py::test_the_trainer_computes_each_router_as_its_model_does"]),
    ("errors-uncounted", "metrics: a session's refused answers are not counted",
     '        s.counts["server/5xx" if status >= 500 else "server/4xx"] += 1', "        pass", [f"{SV}::test_a_sessions_refused_answers_are_counted_in_its_episode"]),
    ("n-choices-chained", "token identity: with n > 1 after earlier turns, a choice extends another's reply",
     "seg = prep.seg if len(completions) == 1 else None", "seg = prep.seg",
     [f"{SV}::test_n_choices_after_earlier_turns_each_extend_the_conversation_not_each_other"]),
    # -- faults ----------------------------------------------------------------------------------------------------
    ("failed-stage-relabels", "versions: an engine whose update could not be staged takes the new label anyway",
     "await self.resume(self.version)", "await self.resume(version)",
     [f"{FA}::test_a_failed_weight_update_never_mislabels_a_token"]),
    # (no mutation skips the deliberate exit after a load that failed twice: vLLM 0.32's layerwise reload leaves the
    # layers it did not reach on the meta device, so such an engine dies at its next step anyway: equivalent here)
    ("coalesce-cancel", "faults: cancelling one member of a coalesced request strands the others",
     "if not f.done():  # a member whose episode was cancelled", "if True:  # a member whose episode was cancelled",
     [f"{EN}::test_a_coalesced_request_survives_a_cancelled_member"]),
    ("bad-row-fatal", "faults: a data row with an unreadable image stops the run",
     'return GroupOut([], {}, self.router.failures, {"bad_row": 1})', "raise",
     [f"{AG}::test_a_row_that_cannot_be_used_costs_only_itself"]),
    ("eval-dead-pools", "faults: evaluation sends prompts to dead agent pools",
     "                alive = self.alive_pools()\n                return await", "                alive = self.pools\n"
     "                return await", [f"{RO}::test_a_bad_row_or_a_dead_pool_costs_that_work_only"]),
    ("no-watchdog", "faults: the trainer waits forever for a stalled rollout",
     "await asyncio.wait_for(self.changed.wait(), max(left, 0))", "await self.changed.wait()",
     [f"{FA}::test_a_stalled_rollout_ends_the_run_with_a_message"]),
    ("gc-left-off", "start-up: the garbage collector stays off after an actor has started (memory grows unbounded)",
     "            gc.freeze()\n            gc.enable()", "            gc.freeze()",
     [f"{EN}::test_start_up_holds_the_collector_off_then_freezes_what_it_built"]),
    ("render-cache-key", "token identity: the render cache answers a generation-prompt render with one without it",
     "key = json.dumps([msgs, tools, generation, extra])", "key = json.dumps([msgs, tools, extra])",
     [f"{AG}::test_the_codec_renders_what_the_template_renders_whatever_it_cached"]),
    ("render-cache-vars", "token identity: the render cache answers a render with other template variables",
     "key = json.dumps([msgs, tools, generation, extra])", "key = json.dumps([msgs, tools, generation])",
     [f"{AG}::test_the_codec_renders_what_the_template_renders_whatever_it_cached"]),
    ("orphan-engine-core", "faults: a forked engine core outlives an engine actor that left the run",
     "    os.register_at_fork(after_in_child=_die_with_parent)", "    pass",
     [f"{FA}::test_a_failed_weight_update_never_mislabels_a_token"]),
    # -- server under hostile input, SFT, micro-batching, placement -------------------------------------------------
    ("json-surrogates", "server: a lone UTF-16 surrogate reaches the tokenizer (a 500)",
     '        elif isinstance(v, str) and re.search("[\\ud800-\\udfff]", v):', '        elif False:',
     [f"{SF}::test_minimal_repros_answer_4xx_in_shape"]),
    ("template-kwargs-clash", "server: chat_template_kwargs may override the template's own arguments (a 500)",
     "    _require(not clash, f\"chat_template_kwargs may not set", "    _require(True, f\"chat_template_kwargs may not set",
     [f"{SF}::test_minimal_repros_answer_4xx_in_shape"]),
    ("sft-trains-context", "sft: the end-of-turn text after a reply is trained as if the model wrote it",
     "        s.add_context(codec.encode(reply[cut:])[0] if reply[cut:] else [])",
     "        rest = codec.encode(reply[cut:])[0] if reply[cut:] else []\n"
     "        s.extend(rest, [0.0] * len(rest), [0] * len(rest), 1.0)",
     [f"{SFT}::test_sft_sample_trains_exactly_the_assistant_turns"]),
    ("budget-ignored", "micro-batching: packing overruns the token budget",
     "        if out[-1] and size > t.max_tokens_per_micro_batch:",
     "        if out[-1] and len(out[-1]) >= t.micro_batch_size:",
     [f"{TR}::test_token_budget_packs_under_the_budget_longest_first"]),
    ("pack-no-restart", "packing: positions run on across samples in a packed row, so attention crosses them",
     '        mb["pos"] = torch.cat([torch.arange(len(s.tokens)) for s in rows]).to(device)[None]',
     '        mb["pos"] = torch.arange(sum(len(s.tokens) for s in rows)).to(device)[None]',
     [f"{TR}::test_a_packed_micro_batch_computes_what_the_padded_one_does"]),
    ("offload-no-write-back", "offload: the host copies step but the device parameters keep their old values",
     "            local_shard(p).copy_(m)\n", "            pass\n",
     [f"{TR}::test_optimizer_offload_steps_host_copies_and_resumes"]),
    ("pack-temperature-shift", "packing: each token is scored at its neighbour's sampling temperature",
     '    temperature = packed(F.pad(mb["temperature"], (0, 1), value=1.0), mb)[:, :-1]',
     '    temperature = packed(F.pad(mb["temperature"], (0, 1), value=1.0), mb)[:, 1:]',
     [f"{TR}::test_a_packed_micro_batch_computes_what_the_padded_one_does"]),
    ("placement-no-critic", "placement: the critic's GPUs are left out of the plan",
     '        plan["critic"] = cfg.train.num_ranks', '        pass',
     [f"{CF}::test_cuda_only_knobs_and_the_gpu_plan_are_checked_before_anything_starts"]),
    # -- launch checks and builders --------------------------------------------------------------------------------
    ("kl-in-reward-ignored", "config: --algo.kl-in-reward is accepted where the estimator ignores it",
     "    if algo.kl_in_reward and not est.token_rewards:", "    if False:",
     [f"{CF}::test_invalid_combinations_are_refused_naming_the_flag"]),
    ("gspo-ppo-clip", "config: GSPO gets PPO's clip band by default",
     '"gspo": dict(clip_low=3e-4, clip_high=4e-4', '"gspo": dict(clip_low=0.2, clip_high=0.28',
     [f"{CF}::test_each_loss_gets_its_own_defaults"]),
    ("critic-lm", "models: the critic is built as a language model and reads vocabulary logit 0 as its value",
     'lr=lambda cfg: cfg.critic.lr, value=True)', "lr=lambda cfg: cfg.critic.lr)",
     [f"{MO}::test_the_critic_is_a_value_model_on_every_backend"]),
    ("automodel-gate-bf16", "MoE: AutoModel's gate keeps its bf16 projection under --actor.fp32-router",
     "gate.gate_precision = gate.score_dtype = torch.float32", "pass",
     [f"{MO}::test_automodel_gates_get_the_fp32_and_freeze_flags"]),
    # -- the trust boundary ----------------------------------------------------------------------------------------
    ("image-path-anywhere", "security: a data row's image may be any file of the host",
     "    if not any(os.path.commonpath([real, base]) == base for base in bases):", "    if False:",
     [f"{AG}::test_data_row_images_come_only_from_the_data_directory"]),
    ("image-decode-first", "security: a text-only model decodes a request's images before refusing them",
     '        _require(not image_parts(turn.messages) or self.codec.processor is not None, "this model does not '
     'take images")', '        _require(not message_images(turn.messages, self.cfg.data) or self.codec.processor '
     'is not None, "this model does not take images")', [f"{AG}::test_a_text_only_model_refuses_images_before_decoding_them"]),
    ("offload-on-the-loop", "agents: offloaded work runs on the pool's event loop",
     "    return await asyncio.wait_for(call, timeout)", "    call.cancel()\n    return fn(*args, **kwargs)",
     [f"{AG}::test_slow_grading_runs_off_the_loop_while_other_episodes_go_on"]),
    ("sandbox-no-pid-namespace", "security: the sandbox sees (and reads) the host's processes",
     '"--unshare-pid", ', "", [f"{SE}::test_no_host_secret_comes_back"], SANDBOX),
    ("sandbox-bwrap-env", "security: bwrap carries the host's environment (API keys) into the sandbox as pid 1",
     "start_new_session=True, env=BWRAP_ENV, cwd=", "start_new_session=True, cwd=",
     [f"{SE}::test_no_host_secret_comes_back"], SANDBOX),
    ("sandbox-network", "security: the sandbox shares the host's network",
     '"--unshare-net", ', "", [f"{SE}::test_no_connection_reaches_the_host"], SANDBOX),
    # (no mutation makes the Python installation writable: as root the sandbox's uid cannot write root's files anyway,
    # so the read-only bind is a layer only a non-root run's tests could tell apart)
    # (no mutation kills only bwrap instead of its process group: with --unshare-pid and --die-with-parent the kernel
    # ends the whole pid namespace when bwrap goes, so the group kill is a second layer the tests cannot tell apart)
    ("grader-no-deadline", "security: the grader waits as long as the verifier takes",
     'out = VERIFIERS.call({"gold": f"${b}$", "answer": f"${a}$"}, TIMEOUT)',
     'out = VERIFIERS.call({"gold": f"${b}$", "answer": f"${a}$"}, 60)',  # 12x the deadline, so the check ends soon
     [f"{SE}::test_the_grader_gives_up_at_its_deadline"], GRADER),
    # -- the trust boundary, third round ----------------------------------------------------------------------------
    ("sandbox-host-root", "security: run as root, the sandbox's uid is host root (a sysctl write, core_pattern)",
     "        os.setresuid(uid, uid, uid)\n", "",
     [f"{SE}::test_no_uid_inside_the_sandbox_is_host_root"], SANDBOX),
    ("sandbox-proc-sys-writable", "security: /proc/sys is not read-only inside the sandbox",
     '"--ro-bind", "/proc/sys", "/proc/sys", ', "", [f"{SE}::test_kernel_settings_cannot_be_written"], SANDBOX),
    # (without its seccomp filter at all the sandbox refuses to start: require()'s probe reads Seccomp: 2)
    ("sandbox-seccomp-allows-all", "security: the seccomp filter denies nothing (namespaces, io_uring, keys, ptrace)",
     "    for name in DENIED_CALLS:\n", "    for name in ():\n",
     [f"{SE}::test_calls_a_sandbox_has_no_use_for_are_denied", f"{SE}::test_no_nested_user_namespace_is_made"],
     SANDBOX),
    # (no mutation drops --disable-userns or the fresh session keyring: the seccomp filter denies unshare and the key
    # calls anyway, so these second layers cannot be told apart while it holds; the tests check the effect)
    ("sandbox-memory-per-process", "security: the memory cap holds per process only (forked children add up)",
     '("memory.limit_in_bytes", MEMORY), ("memory.memsw.limit_in_bytes", MEMORY)',
     '("memory.limit_in_bytes", -1), ("memory.memsw.limit_in_bytes", -1)',
     [f"{SE}::test_the_memory_cap_holds_for_the_whole_sandbox"], SANDBOX),
    ("sandbox-tmp-own-tmpfs", "security: /tmp is a tmpfs of its own, outside the one scratch budget",
     '"--symlink", "scratch/.tmp", "/tmp"]', '"--size", str(SCRATCH_BYTES), "--tmpfs", "/tmp"]',
     [f"{SE}::test_dev_shm_tmp_and_scratch_share_one_cap"], SANDBOX),
    ("sandbox-dev-writable", "security: /dev is a writable, uncapped tmpfs",
     '"--remount-ro",\n             "/dev", ', "", [f"{SE}::test_dev_shm_tmp_and_scratch_share_one_cap"], SANDBOX),
    ("sandbox-failure-as-output", "faults: a sandbox that cannot start reads as the program's own failure (reward 0)",
     "    if not err.startswith(STARTED):", "    if False:",
     [f"{SE}::test_a_sandbox_that_cannot_start_is_an_error_not_a_failed_program"], SANDBOX),
    ("sandbox-resolved-venv-only", "faults: a virtual environment reached through a symlink is not bound where it runs",
     "for p in (real, os.path.abspath(prefix))", "for p in (real,)",
     [f"{SE}::test_a_symlinked_virtual_environment_still_runs"], SANDBOX),
    ("code-test-in-solution", "security: the whole assertion runs in the solution's process (its __eq__, its sorted)",
     "if isinstance(node, ast.expr) and root_name(node) in self.solution:", "if isinstance(node, ast.expr):",
     [f"{SE}::test_the_usual_test_forms_cannot_be_forged"], CODE),
    ("grader-units-as-variables", "security: the verifier drops a letter after a number as a unit (gold 3m accepts 3)",
     "basic_latex=True, units=False,", "basic_latex=True, units=True,",
     [f"{SE}::test_units_and_equations_are_read_as_written"], GRADER),
    ("judge-second-score", "security: a judge reply that quotes the candidate's own score is read",
     "if verdict is None or ANY_SCORE.search(rest) or", "if verdict is None or",
     [f"{SE}::test_a_judge_reply_with_two_scores_or_foreign_digits_is_unparsed"], JUDGE),
    ("judge-any-digits", "security: a verdict in non-ASCII digits is read",
     'VERDICT = re.compile(r"Score: ?([0-9]{1,2})(?:/10)?", re.ASCII)', 'VERDICT = re.compile(r"Score: ?(\\d{1,2})(?:/10)?")',
     [f"{SE}::test_a_judge_reply_with_two_scores_or_foreign_digits_is_unparsed"], JUDGE),
    ("codec-specials-from-content", "security: a special token's spelling in unsampled text becomes that token",
     'return self.spellings.sub(lambda m: m[0][0] + MARK + m[0][1:], value.replace(MARK, "\\ufffd"))', "return value",
     [f"{SE}::test_special_token_spellings_in_content_stay_text",
      f"{SE}::test_the_engine_sees_user_system_tool_and_judged_text_as_text",
      f"{SE}::test_the_env_path_tokenizes_observations_as_text"]),
    ("server-no-header-timeout", "availability: a connection that never finishes its headers stays open",
     "self.timer = asyncio.get_running_loop().call_later(self.header_timeout, transport.abort)", "self.timer = None",
     [f"{SE}::test_a_slow_loris_batch_is_refused_and_the_server_serves_on"]),
    ("server-no-connection-cap", "availability: a pool's server accepts any number of connections",
     "        if len(self.connections) >= self.cap:", "        if False:",
     [f"{SE}::test_a_slow_loris_batch_is_refused_and_the_server_serves_on"]),
    ("plot-encode-on-the-loop", "availability: tool plots are encoded on the pool's event loop",
     '"content": await molt.offload(run_tool, arguments)}', '"content": run_tool(arguments)}',
     [f"{SE}::test_tool_plots_are_downscaled_and_encoded_off_the_loop"], GEO),
    # -- second cases (#48): beside what the tests first covered ---------------------------------------------------
    ("instructions-carried", "Responses: a chain keeps its first response's instructions over the request's own",
     'system = [{"role": "system", "content": turn.echo["instructions"]}] if turn.echo["instructions"] else []',
     'system = [{"role": "system", "content": prev.echo["instructions"]}] if prev.echo["instructions"] else []',
     [f"{RS}::test_the_second_case_of_a_chain_instructions_items_storage_and_tools"]),
    ("kept-newest-evicted", "Responses: past 64 stored responses the newest is forgotten instead of the oldest",
     "s.responses.pop(next(iter(s.responses)))", "s.responses.pop(next(reversed(s.responses)))",
     [f"{RS}::test_the_second_case_of_a_chain_instructions_items_storage_and_tools"]),
    ("assistant-items-joined", "Responses: two assistant messages in a row in the input become one",
     'return kind != "message" or not (last.get("content") or last.get("tool_calls"))', "return True",
     [f"{RS}::test_the_second_case_of_a_chain_instructions_items_storage_and_tools"]),
    ("ta-reward-seat0", "TextArena: the reward is the first seat's, whichever seat the policy plays",
     "reward, mine = float(rewards[self.me]), info.get(self.me, {})",
     "reward, mine = float(rewards[0]), info.get(self.me, {})",
     [f"{EV}::test_textarena_games_end_with_the_librarys_outcome",
      f"{EV}::test_textarena_episodes_score_what_the_library_scores_and_train"], "agents/textarena_env.py"),
    ("parts-one-each", "code grader: each assertion is taken to have one solution part (values go to the wrong place)",
     "        at += len(t.parts)", "        at += 1",
     [f"{SE}::test_an_assertion_with_several_solution_parts_gets_each_value_in_its_place"], CODE),
    ("ioctl-high-bits", "sandbox: TIOCSTI with bits above the 32 the kernel reads slips past the filter",
     "sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request)", "sc.Arg(1, sc.EQ, request)",
     [f"{SE}::test_calls_a_sandbox_has_no_use_for_are_denied"], SANDBOX),
    ("no-tioclinux", "sandbox: TIOCLINUX (the other terminal injection) is allowed",
     "TERMINAL_INJECTION = (0x5412, 0x541C)", "TERMINAL_INJECTION = (0x5412,)",
     [f"{SE}::test_calls_a_sandbox_has_no_use_for_are_denied"], SANDBOX),
    ("keep-groups", "sandbox: the host process's supplementary groups go into the sandbox",
     "        os.setgroups([])\n", "",
     [f"{SE}::test_no_supplementary_group_of_the_host_reaches_the_sandbox"], SANDBOX),
    ("image-bytes-unchecked", "sandbox: an image over the byte cap is decoded when the code sends it itself",
     "if n > IMAGE_BYTES or len(blob) != n:", "if len(blob) != n:",
     [f"{SE}::test_an_image_over_either_cap_is_never_decoded"], SANDBOX),
    ("image-pixels-unchecked", "sandbox: an image over the pixel cap (under PIL's own bomb guard) is decoded",
     'if im.format == "PNG" and im.width * im.height <= IMAGE_PIXELS:', 'if im.format == "PNG":',
     [f"{SE}::test_an_image_over_either_cap_is_never_decoded"], SANDBOX),
    ("named-tool-first", "tool_choice: a call forced by name is written for the first tool offered",
     "    return name\n\n\ndef _response_format(", "    return names[0]\n\n\ndef _response_format(",
     [f"{RS}::test_the_second_case_of_a_chain_instructions_items_storage_and_tools"]),
    # -- added with the agent CLIs (#50) and the trained-positions head ---------------------------------------------
    ("program-host-network", "sandbox: a program shares the host's network (an agent CLI reaches any host port)",
     '"--unshare-pid", "--unshare-net",', '"--unshare-pid",',
     [f"{SE}::test_a_sandboxed_client_reaches_its_session_through_the_relay_and_nothing_else"], SANDBOX),
    ("shared-split-specials", "text is text: content's special spellings flip split_special_tokens on the shared "
     "tokenizer (another thread's template loses its specials)",
     'self.literal(distinct, add_special_tokens=False)["input_ids"]',
     'self.tokenizer(distinct, add_special_tokens=False, split_special_tokens=True)["input_ids"]',
     [f"{SE}::test_content_marked_on_one_thread_never_splits_the_template_tokenized_on_another"]),
    ("packed-need-padded", "forward consistency: packed rows take the head at the padded layout's positions",
     'need = packed(F.pad(mb["mask"], (0, 1)), mb)[:, :-1] > 0', 'need = mb["mask"] > 0',
     [f"{TR}::test_a_packed_micro_batch_computes_what_the_padded_one_does"]),
    ("max-tokens-raised", "wires: a client's max_tokens above the run's replaces the run's cap",
     's.ep.sampling.get("max_tokens"))), default=None)}', '0)), default=None)}',
     [f"{SV}::test_the_runs_max_tokens_caps_what_a_client_asks_and_a_smaller_ask_is_honoured"]),
]


def scratch_copy() -> Path:
    root = Path(tempfile.mkdtemp(prefix="molt-mutation-"))
    for f in ("molt.py", "molt_view.py"):
        shutil.copy(ROOT / f, root / f)
    for d in ("tests", "agents", "rewards", "examples", "scripts"):
        shutil.copytree(ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def run_tests(root: Path, tests: list[str], timeout: int) -> tuple[int, str]:
    """(pytest's exit code, or -1 past the timeout; the tail of its output)."""
    env = {**os.environ, "PYTHONPATH": str(root)}  # the scratch molt.py, ahead of the editable install
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timed out"
    return proc.returncode, proc.stdout[-3000:]


def main(args):
    chosen = [(*m, "molt.py")[:6] for m in MUTATIONS if not args.only or args.only in m[0] or args.only in m[1]]
    if args.list:
        for name, why, _, _, tests, _ in chosen:
            print(f"{name:24s} {why}\n{'':24s} -> {', '.join(t.split('::')[-1] for t in tests)}")
        return 0
    root = scratch_copy()
    try:
        if not args.no_baseline:  # an unmutated failure would make every mutation look caught
            tests = sorted({t for m in chosen for t in m[4]})
            rc, tail = run_tests(root, tests, args.timeout)
            if rc != 0:
                print(f"the unmutated tests fail (exit {rc}): fix them first\n{tail}", file=sys.stderr)
                return 2
        caught, rows = 0, []
        for name, why, pattern, replacement, tests, path in chosen:
            original = (root / path).read_text()
            if original.count(pattern) != 1:
                rows.append(f"STALE   {name}: pattern occurs {original.count(pattern)} times in {path}")
                continue
            (root / path).write_text(original.replace(pattern, replacement))
            t0 = time.time()
            rc, _ = run_tests(root, tests, args.timeout)
            (root / path).write_text(original)
            verdict = "caught" if rc in (1, -1) else ("MISSED" if rc == 0 else f"ERROR rc={rc}")
            caught += verdict == "caught"
            rows.append(f"{verdict:7s} {name:24s} {time.time() - t0:5.0f}s  {why}")
            print(rows[-1], flush=True)
        print(f"\nscore: {caught}/{len(chosen)} caught ({100 * caught / max(1, len(chosen)):.0f} %)")
        for row in rows:
            if not row.startswith("caught"):
                print(row)
        return 0 if caught == len(chosen) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="run the mutations whose name or invariant contains this text")
    p.add_argument("--list", action="store_true", help="list the mutations and their tests")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selected tests")
    p.add_argument("--timeout", type=int, default=900, help="seconds per test run")
    sys.exit(main(p.parse_args()))
