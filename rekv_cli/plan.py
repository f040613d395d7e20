"""`rekv profile`, `rekv gate`, `rekv regate` and `rekv plan`: measuring, gating (and judging a
policy's generations again) and asking the planner."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rekv_cli.bench.provenance import provenance
from rekv_cli.util import csv_of, write_json
from rekv_core.model.shapes import DEFAULT_MODEL

SPLITZIP_CALIBRATION = 4  # text windows SplitZip's codebooks are ranked over
# what `rekv gate` and `rekv regate` measure: the gate and its policy over every codec on the model
GATE_MEASURES = ("rekv_core/plan/gate.py", "rekv_core/plan/generations.py",
                 "rekv_core/plan/policy.py", "rekv_core/plan/policy_meta.py", "rekv_core/codecs",
                 "rekv_core/kernels", "rekv_core/model", "rekv_core/eval", "rekv_core/settings.py",
                 "rekv_cli/plan.py")


def _runtime_flags(parser) -> None:
    parser.add_argument("--model", default=None, help="model source (env REKV_MODEL)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (env REKV_DEVICE)")
    parser.add_argument("--dtype", default=None, help="auto, float32 or bfloat16 (env REKV_DTYPE)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (env REKV_TORCH_THREADS; 0 = all cores)")


def _load_model(args):
    from rekv_core.settings import RuntimeSettings

    settings = RuntimeSettings.from_env(model=args.model, device=args.device, dtype=args.dtype,
                                        torch_threads=args.threads)
    settings.apply_threads()
    return settings.load_model(), settings


def _generation_flags(parser) -> None:
    parser.add_argument("--generation-tokens", type=int, default=48,
                        help="greedy tokens decoded per calibration prompt for the generation-"
                             "agreement criterion (default 48; 0: skip it)")
    parser.add_argument("--generation-prose", type=int, default=1,
                        help="prose windows (1024 tokens or the prompt length) of the text in "
                             "the generation set, beside its code, chat and passkey prompts")


def _generation_set(args, tokenizer, text_ids, prompt_len: int):
    from rekv_core.eval.generation_set import generation_prompts

    if args.generation_tokens < 0:
        raise ValueError(f"generation-tokens: must be >= 0, got {args.generation_tokens}")
    if args.generation_tokens == 0:
        return []
    return generation_prompts(tokenizer, text_ids, args.generation_prose,
                              min(1024, prompt_len), prompt_len)


def _gate_tokenizer(args, model, settings):
    from rekv_core.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or settings.model)
    if tokenizer is None:
        raise ValueError("tokenizer: the gate needs one; pass --tokenizer FILE.gguf or "
                         "--tokenizer embedded")
    if tokenizer.vocab_size > model.shape.vocab_size:
        raise ValueError(f"tokenizer: {tokenizer.vocab_size} tokens exceed the model's "
                         f"vocabulary of {model.shape.vocab_size}")
    return tokenizer


def _add_regate_parser(sub) -> None:
    regate = sub.add_parser("regate", help="judge a policy's eligible lossy codecs by greedy "
                            "generation agreement, lowering max cuts that fail (bisection)")
    _runtime_flags(regate)
    regate.add_argument("--policy", required=True, help="the policy to judge (`rekv gate`)")
    regate.add_argument("--text", required=True, help="plain-text corpus for the prose prompts")
    regate.add_argument("--tokenizer", default=None, help="as for `rekv gate`")
    regate.add_argument("--prompt-len", type=int, default=None,
                        help="the passkey prompt's length (default: the policy's prompt length)")
    regate.add_argument("--codecs", type=csv_of(str), default=None,
                        help="judge only these codecs (default: every lossy eligible one)")
    regate.add_argument("--combine", nargs="+", metavar="RUN", default=None,
                        help="no model: combine runs of `rekv regate --codecs` on --policy, each "
                             "on other codecs, into one policy")
    regate.add_argument("--out", required=True, help="the policy file to write (JSON)")
    _generation_flags(regate)
    regate.set_defaults(func=cmd_regate)


def add_plan_parsers(sub) -> None:
    profile = sub.add_parser("profile", help="measure per-layer costs on this machine")
    _runtime_flags(profile)
    profile.add_argument("--lengths", type=csv_of(int), default=[64, 256, 1024, 2048],
                         help="prompt lengths for the layer cost (default 64,256,1024,2048)")
    profile.add_argument("--codecs", type=csv_of(str), default=["bf16", "int8", "int4"])
    profile.add_argument("--out", required=True, help="the profile file to write (JSON)")
    profile.set_defaults(func=cmd_profile)

    gate = sub.add_parser("gate", help="evaluate actions against BF16 and write a policy")
    _runtime_flags(gate)
    gate.add_argument("--text", required=True, help="plain-text evaluation corpus, e.g. "
                      "WikiText-2's wiki.test.raw")
    gate.add_argument("--prompt-len", type=int, default=2048)
    gate.add_argument("--prompts", type=int, default=32)
    gate.add_argument("--continuation", type=int, default=256)
    gate.add_argument("--codecs", type=csv_of(str),
                      default=["int8", "int4", "int4h", "spectrum30", "spectrum50", "splitzip"])
    gate.add_argument("--probe-context", type=int, default=4096,
                      help="prompt tokens of SpectrumKV's INT4 probe, run when a spectrum codec "
                           "is gated (its verdict goes into the policy); 0: skip the probe")
    gate.add_argument("--cuts", type=csv_of(int), default=None,
                      help="cuts to evaluate (default every 3rd layer and L)")
    gate.add_argument("--epsilon", type=float, default=0.01,
                      help="largest relative perplexity rise allowed (default 0.01)")
    gate.add_argument("--tokenizer", default=None,
                      help="a .gguf whose tokenizer reads the text, or `embedded` (SmolLM2's); "
                           "default: the model's own. Synthetic weights and checkpoint "
                           "directories need one")
    gate.add_argument("--out", required=True, help="the policy file to write (JSON)")
    gate.add_argument("--merge", metavar="POLICY", default=None,
                      help="add these verdicts to an existing policy from the same model, text "
                           "and settings (codecs evaluated here replace its verdicts of them)")
    gate.add_argument("--json", metavar="FILE", help="also write the verdicts as JSON")
    _generation_flags(gate)
    gate.set_defaults(func=cmd_gate)

    _add_regate_parser(sub)

    plan = sub.add_parser("plan", help="the action the planner would choose, and why")
    plan.add_argument("--model", default=DEFAULT_MODEL, help="a preset name")
    plan.add_argument("--prompt-len", type=int, required=True)
    plan.add_argument("--link-gbps", type=float, required=True)
    plan.add_argument("--profile", default=None, help="`rekv profile` output (default: this "
                      "machine's cached profile, as the services keep it; else the profile "
                      "shipped for the model, measured on another machine)")
    plan.add_argument("--measure", action="store_true", help="measure this machine's profile "
                      "when none is cached (loads the model: synthetic weights of its shape for "
                      "a preset without weights) and cache it")
    plan.add_argument("--unmeasured-link", action="store_true", help="plan as a fresh pair "
                      "does before its first link sample: --link-gbps is only a prior")
    plan.add_argument("--device", default=None, help="the profile's device: cpu, cuda or cuda:N "
                      "(env REKV_DEVICE)")
    plan.add_argument("--dtype", default=None, help="the profile's dtype (env REKV_DTYPE)")
    plan.add_argument("--threads", type=int, default=None,
                      help="the profile's torch threads (env REKV_TORCH_THREADS; 0 = all cores)")
    plan.add_argument("--policy", default=None, help="`rekv gate` output (default: the policy "
                      "shipped for the model; none: lossless actions only)")
    plan.add_argument("--codecs", type=csv_of(str), default=["bf16", "int8", "int4"])
    plan.add_argument("--load", type=int, default=1, help="handoffs in flight on the decode "
                      "worker (scales its suffix cost)")
    plan.add_argument("--schedule", choices=("auto", "streamed", "pipelined", "seed"),
                      default="auto",
                      help="streamed: the handoff from inside a prefill that stops at the cut, "
                           "each layer as it is computed; pipelined: the prefill in the boundary's "
                           "token chunks, each chunk sent as it passes the cut; auto (the "
                           "services' default): streamed, in whichever order predicts less; "
                           "seed: a full prefill, then the handoff")
    plan.add_argument("--chunk-tokens", type=int, default=256,
                      help="the boundary's chunk size, a multiple of 256; 0: one message "
                           "(default 256)")
    plan.add_argument("--quality", choices=("lossless", "gated"), default="gated",
                      help="the request's quality setting: lossless keeps to actions that "
                           "reproduce the reference bit for bit (default gated: also what the "
                           "policy passed)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead")
    plan.set_defaults(func=cmd_plan)


def cmd_profile(args: argparse.Namespace) -> int:
    from rekv_core.plan.profile import measure_profile

    model, settings = _load_model(args)
    profile = measure_profile(model, args.codecs, args.lengths)
    profile.save(args.out)
    print(json.dumps(profile.to_json(), indent=1))
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    started = provenance(measures=GATE_MEASURES)
    from rich.console import Console
    from rich.table import Table

    from rekv_core.codecs import get_codec
    from rekv_core.plan.gate import GateConfig, calibrate_splitzip, probe_spectrum, run_gate
    from rekv_core.plan.policy import Policy, deployed_codec
    from rekv_core.plan.policy_meta import PolicyMeta

    for codec in args.codecs:
        get_codec(codec)
    text = Path(args.text).read_text(encoding="utf-8")
    model, settings = _load_model(args)
    tokenizer = _gate_tokenizer(args, model, settings)
    L = model.shape.num_layers
    cuts = args.cuts or sorted({*range(3, L, 3), L})
    for cut in cuts:
        if not 1 <= cut <= L:
            raise ValueError(f"cuts: each must lie in [1, {L}], got {cut}")
    console = Console(stderr=True)
    config = GateConfig(prompt_len=args.prompt_len, prompts=args.prompts,
                        continuation=args.continuation, epsilon=args.epsilon,
                        generation_tokens=args.generation_tokens)
    generation = _generation_set(args, tokenizer, tokenizer.encode(text), args.prompt_len)
    probe = None
    if args.probe_context and any(get_codec(c).importance_window for c in args.codecs):
        probe = probe_spectrum(model, tokenizer, args.probe_context, progress=console.log)
        print(f"SpectrumKV probe at {args.probe_context} tokens: INT4 "
              f"{'tolerated' if probe['int4_tolerated'] else 'not tolerated'} -> "
              f"{probe['tiers']} tiers")
    deployed = {"spectrum_probe": probe} if probe else {}
    ruled_out = [c for c in args.codecs if deployed_codec(c, deployed) is None]
    if ruled_out:
        print(f"not evaluated: {', '.join(ruled_out)} (no {probe['tiers']}-tier form at its "
              f"budget)")
    policy = run_gate(model, tokenizer, tokenizer.encode(text),
                      [(codec, cut) for codec in args.codecs if codec not in ruled_out
                       for cut in cuts], config,
                      progress=console.log, codec_for=lambda name: deployed_codec(name, deployed),
                      generation=generation)
    policy.max_cut.update({codec: 0 for codec in ruled_out})
    found = {"text": Path(args.text).name, "command": "rekv " + " ".join(sys.argv[1:]),
             **started}
    if "splitzip" in args.codecs:
        found["splitzip"] = calibrate_splitzip(model, tokenizer.encode(text), args.prompt_len,
                                               SPLITZIP_CALIBRATION)
    if probe:
        found["spectrum_probe"] = probe
    policy.meta = policy.meta.merged(PolicyMeta.from_json(found))
    if args.merge:
        policy = Policy.load(args.merge).merged(policy)
    policy.save(args.out)
    table = Table(title=f"Quality gate, {model.shape.name}, S = {args.prompt_len}, "
                        f"{args.prompts} prompts + {args.continuation} tokens")
    for column in ("codec", "cut", "eligible", "next-token top-1", "next-token KL",
                   "cont. top-1", "ppl rise", "passkeys", "bytes/layer", "why not"):
        table.add_column(column)
    for v in policy.verdicts:
        table.add_row(v["codec"], str(v["cut"]), "yes" if v["eligible"] else "no",
                      f"{v['next_token_top1_agreement']:.3f}", f"{v['next_token_kl']:.2e}",
                      f"{v['continuation_top1_agreement']:.3f}", f"{v['perplexity_rise']:+.3%}",
                      f"{sum(n['found'] for n in v['needles'])}/{len(v['needles'])}",
                      (f"{v['bytes_per_layer'] / v['bf16_bytes_per_layer']:.3f}×BF16"
                       if "bytes_per_layer" in v else ""),
                      "; ".join(v["reasons"]))
    Console(width=180).print(table)
    print(f"BF16 perplexity {policy.verdicts[0]['bf16_perplexity']:.3f}; passkeys found by BF16: "
          f"{sum(n['found'] for n in policy.meta.bf16_needles)}/"
          f"{len(policy.meta.bf16_needles)}; eligible: "
          + ", ".join(f"{c} up to cut {m}" for c, m in policy.max_cut.items()))
    write_json(args.json, policy.to_json(), indent=1)
    return 0


def cmd_regate(args: argparse.Namespace) -> int:
    import time

    started = provenance(measures=GATE_MEASURES)
    from rich.console import Console

    from rekv_core.plan.gate import GateConfig, regate_generations
    from rekv_core.plan.policy import Policy, deployed_codec

    if args.generation_tokens < 1:
        raise ValueError(f"generation-tokens: must be >= 1, got {args.generation_tokens}")
    policy = Policy.load(args.policy)
    if args.combine:
        from rekv_core.plan.gate import combine_regates

        combined = combine_regates(policy, [Policy.load(run) for run in args.combine])
        combined.save(args.out)
        print(json.dumps({"max_cut_before": policy.max_cut, "max_cut": combined.max_cut}))
        return 0
    text = Path(args.text).read_text(encoding="utf-8")
    model, settings = _load_model(args)
    if policy.model != model.shape.name:
        raise ValueError(f"policy: written for {policy.model}, the model is {model.shape.name}")
    tokenizer = _gate_tokenizer(args, model, settings)
    prompt_len = args.prompt_len or policy.prompt_len_range[1]
    prompts = _generation_set(args, tokenizer, tokenizer.encode(text), prompt_len)
    began = time.perf_counter()
    regated = regate_generations(
        model, policy, prompts, GateConfig(generation_tokens=args.generation_tokens),
        lambda name: deployed_codec(name, policy.meta), progress=Console(stderr=True).log,
        codecs=args.codecs)
    regated.meta.generation.update({"command": "rekv " + " ".join(sys.argv[1:]),
                                    "text": Path(args.text).name, **started,
                                    "seconds": round(time.perf_counter() - began, 1)})
    regated.save(args.out)
    print(json.dumps({"max_cut_before": policy.max_cut, "max_cut": regated.max_cut,
                      "generation": regated.meta.generation}, indent=1))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from rekv_cli.plan_profile import measured_when, plan_profile

    from rekv_core.handoff import Delivery, Order
    from rekv_core.model.shapes import get_preset
    from rekv_core.plan.calibration import DecodeCalibration, PrefillCalibration
    from rekv_core.plan.planner import Planner
    from rekv_core.plan.policy import Policy, shipped_policy
    from rekv_core.plan.quality import Quality

    shape = get_preset(args.model)
    profile, source = plan_profile(args)
    policy = Policy.load(args.policy) if args.policy else shipped_policy(args.model)
    if args.prompt_len < 1:
        raise ValueError(f"prompt-len: must be positive, got {args.prompt_len}")
    # the two workers as the profile describes them, fresh: no handoff seen, the link as given
    # (measured by the decode side, or only the prior with --unmeasured-link)
    costs = dataclasses.replace(
        DecodeCalibration(shape, profile.layer_cost, profile.restore_ms_per_mib).offer(
            args.prompt_len, args.load),
        link_gbps=None if args.unmeasured_link else args.link_gbps)
    orders = {"auto": frozenset(Order), "pipelined": frozenset({Order.TOKENS})}.get(
        args.schedule, frozenset({Order.LAYERS}))
    inputs = PrefillCalibration(profile.quantize_ms_per_mib, args.link_gbps,
                                profile.layer_cost).cost_inputs(
        shape, args.prompt_len, costs, streamed=args.schedule != "seed",
        chunk_tokens=Delivery(chunk_tokens=args.chunk_tokens).chunk_tokens, orders=orders)
    decision = Planner(policy, explore_every=0).decide(inputs, args.codecs,
                                                       quality=Quality(args.quality))
    measured = measured_when(profile)
    if args.json:
        print(json.dumps({**decision.as_dict(), "profile": {
            "source": source, "measured_at": profile.meta.get("measured_at"),
            "age_s": measured[0], "measured_busy": profile.meta.get("measured_busy")}}))
        return 0
    console = Console()
    link = "prior, unmeasured" if args.unmeasured_link else "measured"
    console.print(f"{shape.name}, S = {args.prompt_len}, link {args.link_gbps:g} Gb/s ({link}), "
                  f"{args.schedule} schedule, profile {profile.device}/{profile.dtype} "
                  f"({source}; {measured[1]}), policy "
                  f"{'none (lossless only)' if policy is None else policy.max_cut}")
    order = " pipelined" if decision.pipelined else ""
    console.print(f"[bold]chosen: {decision.action}{order} — predicted TTFT "
                  f"{decision.predicted_ms:.1f} ms from the prefill's start "
                  f"({decision.rule.value.replace('_', ' ')})")
    table = Table(title="best candidates (all eligible actions are ranked; --json lists them)")
    for column in ("action", "codec", "cut", "order", "TTFT ms", "prefill", "H", "X", "R",
                   "MiB"):
        table.add_column(column)
    for p, ms in decision.candidates[:12]:
        table.add_row(p.action.kind.value, p.action.codec, str(p.action.cut),
                      "tokens" if p.pipelined else "layers", f"{ms:.1f}",
                      f"{p.prefill_ms:.1f}", f"{p.h_ms:.1f}", f"{p.x_ms:.1f}", f"{p.r_ms:.1f}",
                      f"{p.bytes / 2**20:.2f}")
    console.print(table)
    return 0
