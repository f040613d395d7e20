"""The quality gate (seed section 2.4): which actions (b, c) keep the model's output.

For each prompt (a window of the evaluation text), the BF16 prefill of its S prompt tokens gives
the reference cache. An action's reconstructed cache holds layers 0..c−1 through codec b's round
trip and layers c..L−1 unchanged: the suffix recomputed from the BF16 boundary h_c is bit-identical
to the prefill's on the same device and dtype (tested in
`tests/unit/model/test_executor_exactness.py`), so the gate does not re-run it. Both caches then
score the same continuation teacher-forced (`extend`): the next token after the prompt (the first
one decoded from the handed-off cache), then `continuation` tokens.

Per action, over all prompts:
- next-token top-1 agreement with BF16 at the first decoded position, and its mean KL divergence
  (the action's top token agrees when it is one of BF16's top tokens: BF16 logits tie exactly at
  BF16's resolution, and which of the tied tokens argmax returns is arbitrary);
- top-1 agreement and mean KL over the whole continuation (reported);
- continuation perplexity, and its rise relative to BF16's;
- passkey retrieval: prompts of about S tokens with the key at several depths, greedy answers from
  both caches; the action passes where BF16 passes;
- generation agreement (`plan.generations`, given a calibration set): greedy continuations of
  code, chat-style and prose prompts from both caches, scored by the first divergence and the
  share of continuations that match exactly, against `GenerationFloor` (no divergence before
  token 16, at least 3/4 matching over 48 tokens; that module says why).
An action is eligible when every first-position top-1 equals BF16's, the perplexity rises by at
most `epsilon` (relative), every passkey BF16 finds, it finds, and its generations meet the floor.
Anything else is a failure, whatever the action's speed, and the verdict says which criterion
failed.

`regate_generations(model, policy, prompts, config)` judges an existing policy's eligible lossy
codecs by generation agreement alone: per codec, the largest passing cut up to its max cut by
bisection (`generations.largest_passing_cut`), which lowers the policy's max cut where generations
fail; its teacher-forced verdicts stand (a smaller cut quantizes fewer layers), those above the
new max cut are marked ineligible, and the policy's meta records the run (`generation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rekv_core.codecs import Codec, EncodeContext, get_codec
from rekv_core.codecs.spectrum import SpectrumCodec
from rekv_core.eval.needle import answer_found, passkey_prompt
from rekv_core.eval.spectrum_probe import PROBE_CONTEXT, NeedleTrial, probe_int4_tolerance
from rekv_core.kernels import ExponentHistogram
from rekv_core.model import KVCache, Model, decode_greedy, extend, prefill
from rekv_core.eval.generation_set import GenerationPrompt
from rekv_core.plan import generations
from rekv_core.plan.generations import GENERATION_TOKENS, GenerationFloor, GenerationScore
from rekv_core.plan.policy import Policy
from rekv_core.plan.policy_meta import PolicyMeta


PROBE_TOKENS = 10  # greedy tokens decoded for a probe's answer


@dataclass
class GateConfig:
    prompt_len: int = 2048
    prompts: int = 32
    continuation: int = 256
    epsilon: float = 0.01
    needle_depths: Sequence[float] = (0.1, 0.5, 0.9)
    needle_tokens: int = 10
    generation_tokens: int = GENERATION_TOKENS
    floor: GenerationFloor = GenerationFloor()


@dataclass
class _Tally:
    first_agree: int = 0
    first_kl: float = 0.0
    all_agree: int = 0
    all_kl: float = 0.0
    positions: int = 0
    nll: float = 0.0
    scored: int = 0
    prompts: int = 0
    needles: list = field(default_factory=list)
    payload_bytes: int = 0  # of the encoded prefix layers, for bytes per layer
    layers: int = 0
    generation: GenerationScore | None = None


def text_windows(ids: Sequence[int], length: int, count: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over `ids`."""
    if len(ids) < length:
        raise ValueError(f"text: {len(ids)} tokens, need at least {length} for one window")
    step = max(1, (len(ids) - length) // max(1, count - 1))
    starts = [min(i * step, len(ids) - length) for i in range(count)]
    return [list(ids[s:s + length]) for s in starts]


def importance_window(actions: Sequence[tuple[str, int]],
                      codec_for: Callable[[str], Codec] = get_codec) -> int:
    """The prefill's importance window the actions' codecs need (0: none)."""
    return max((codec_for(codec).importance_window for codec, _ in actions), default=0)


def reconstructed_cache(keys, values, codec: str | Codec, cut: int, capacity: int,
                        importance: Sequence[torch.Tensor] = (), tally: _Tally | None = None
                        ) -> KVCache:
    """`codec`: a registered name or a built codec. `importance`: each layer's token scores, for
    codecs that rank tokens. `tally`: counts the encoded layers' payload bytes."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    new_keys, new_values = [], []
    for index, (k, v) in enumerate(zip(keys, values)):
        if index < cut:
            context = EncodeContext(importance[index] if index < len(importance) else None)
            encoded = codec.encode(k, v, checksums=False, context=context)
            if tally is not None:
                tally.payload_bytes += encoded.payload_bytes
                tally.layers += 1
            k2, v2 = codec.decode(encoded, verify=False)
            k, v = k2.to(k.dtype), v2.to(v.dtype)
        new_keys.append(k)
        new_values.append(v)
    return KVCache.from_layers(new_keys, new_values, capacity)


def within_resolution(picked: torch.Tensor, top: torch.Tensor, dtype: torch.dtype
                      ) -> torch.Tensor:
    """Whether reference logits `picked` lie within one unit in the last place of `dtype`
    (at the magnitude of `top`, the maximal logit) of `top`: the model computes its logits in
    `dtype`, so logits that close are tied at its resolution."""
    eps = torch.finfo(dtype).eps
    ulp = eps * torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(torch.finfo(dtype).tiny))))
    return picked >= top - ulp


def _score(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor, tally: _Tally,
           nll_only: bool = False, dtype: torch.dtype = torch.float32) -> None:
    logp = F.log_softmax(logits.float(), dim=-1)
    if not nll_only:
        ref_logp = F.log_softmax(reference.float(), dim=-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # KL(BF16 || action) per position
        # Logits of a BF16 model are BF16 numbers: tokens within one unit in the last place of the
        # maximum are tied at the model's resolution, and which of them argmax returns moves with
        # any rounding change (a different GEMM blocking alone flips it). The action agrees when
        # BF16 gives its top token a logit tied with the maximum in that sense.
        picked = reference.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
        agree = within_resolution(picked, reference.max(-1).values, dtype)
        tally.first_agree += int(agree[0])
        tally.first_kl += float(kl[0])
        tally.all_agree += int(agree.sum())
        tally.all_kl += float(kl.sum())
        tally.positions += agree.numel()
    tally.nll -= float(logp[:-1].gather(-1, targets[:, None]).sum())
    tally.scored += targets.numel()
    tally.prompts += 1


def run_gate(model: Model, tokenizer, text_ids: Sequence[int],
             actions: Sequence[tuple[str, int]], config: GateConfig,
             progress: Callable[[str], None] = lambda _: None,
             codec_for: Callable[[str], Codec] = get_codec,
             generation: Sequence[GenerationPrompt] = ()) -> Policy:
    """The verdict on every (codec, cut) of `actions`, each codec built by `codec_for` (the
    registry's, or as the model deploys it: `policy.deployed_codec`); with `generation` prompts,
    their greedy continuations too."""
    S, T = config.prompt_len, config.continuation
    windows = text_windows(text_ids, S + 1 + T, config.prompts)
    reference = _Tally()
    tallies = {a: _Tally() for a in actions}
    capacity = S + 1 + T
    scored_by = importance_window(actions, codec_for)
    for number, window in enumerate(windows, 1):
        prompt, follow = window[:S], torch.tensor(window[S:])
        state = prefill(model, prompt, boundaries=(), importance_window=scored_by)
        ref_cache = KVCache.from_layers(state.keys, state.values, capacity)
        ref_logits = extend(model, follow, ref_cache)  # predicts follow[1:], then one more
        _score(ref_logits, ref_logits, follow[1:], reference, nll_only=True)
        for codec, cut in actions:
            cache = reconstructed_cache(state.keys, state.values, codec_for(codec), cut,
                                        capacity, state.importance, tallies[codec, cut])
            _score(extend(model, follow, cache), ref_logits, follow[1:], tallies[codec, cut],
                   dtype=model.dtype)
        progress(f"prompt {number}/{len(windows)} scored")
    _needles(model, tokenizer, actions, config, reference, tallies, progress, codec_for)
    if generation:
        refs = generations.references(model, generation, config.generation_tokens, scored_by)
        for codec, cut in actions:
            tallies[codec, cut].generation = generations.score(
                model, refs, codec_for(codec), cut, reconstructed_cache)
            progress(f"{codec} at cut {cut}: generations diverge first at token "
                     f"{tallies[codec, cut].generation.earliest}")
    return _verdicts(model, actions, config, reference, tallies)


def regate_generations(model: Model, policy: Policy, prompts: Sequence[GenerationPrompt],
                       config: GateConfig, codec_for: Callable[[str], Codec],
                       progress: Callable[[str], None] = lambda _: None,
                       codecs: Collection[str] | None = None, verify: int = 1) -> Policy:
    """`policy` with each lossy codec's max cut (of `codecs`; None: all) lowered to the largest
    that meets the generation floor (module doc); `codec_for`: the codecs as the policy deploys
    them; `verify`: cuts checked below the one bisection finds."""
    codecs = set(policy.max_cut if codecs is None else codecs)
    window = importance_window([(c, m) for c, m in policy.max_cut.items() if m and c in codecs],
                               codec_for)
    refs = generations.references(model, prompts, config.generation_tokens, window)
    scores: dict[tuple[str, int], GenerationScore] = {}
    searches = {}
    for codec, high in policy.max_cut.items():
        built = codec_for(codec) if codec in codecs else None
        if high == 0 or built is None or built.lossless:
            continue

        def passes(cut: int, codec=codec, built=built) -> bool:
            scores[codec, cut] = generations.score(model, refs, built, cut, reconstructed_cache,
                                                   config.floor)
            verdict = config.floor.reasons(scores[codec, cut])
            progress(f"{codec} at cut {cut}: " + ("; ".join(verdict) or "passes"))
            return not verdict

        searches[codec] = generations.largest_passing_cut(passes, high, verify)
    verdicts = []
    for verdict in policy.verdicts:
        codec, cut = verdict["codec"], verdict["cut"]
        verdict = dict(verdict)
        if (codec, cut) in scores:
            verdict.update(scores[codec, cut].to_json())
        if codec in searches and cut > searches[codec].max_cut and verdict["eligible"]:
            verdict["eligible"] = False
            verdict["reasons"] = [*verdict["reasons"], *(
                config.floor.reasons(scores[codec, cut]) if (codec, cut) in scores else
                [f"above cut {searches[codec].max_cut}, the largest whose generations meet "
                 f"the floor"])]
        verdicts.append(verdict)
    record = {"tokens": config.generation_tokens, "floor": config.floor.to_json(),
              "prompts": [{"kind": r.prompt.kind, "tokens": len(r.prompt.ids)} for r in refs],
              "search": f"bisection on the cut up to the earlier max cut, then {verify} "
                        f"check(s) below; an action's decoding stops once it fails the floor",
              "codecs": {codec: {"max_cut_before": policy.max_cut[codec],
                                 "max_cut": search.max_cut, "monotone": search.monotone,
                                 "evaluated": [{"cut": cut, "passed": ok,
                                                **scores[codec, cut].to_json()}
                                               for cut, ok in sorted(search.evaluated.items())]}
                         for codec, search in searches.items()}}
    return Policy(policy.model, policy.prompt_len_range,
                  {**policy.max_cut, **{c: s.max_cut for c, s in searches.items()}},
                  policy.epsilon, verdicts,
                  policy.meta.merged(PolicyMeta(generation=record)))


def _needles(model, tokenizer, actions, config, reference, tallies, progress, codec_for
             ) -> None:
    filler = _filler_repeats(tokenizer, config.prompt_len)
    scored_by = importance_window(actions, codec_for)
    for depth in config.needle_depths:
        key = 10000 + int(depth * 80000) + 17
        ids = tokenizer.encode(passkey_prompt(key, filler, depth))
        state = prefill(model, ids, boundaries=(), importance_window=scored_by)
        capacity = len(ids) + config.needle_tokens
        ref_cache = KVCache.from_layers(state.keys, state.values, capacity)
        ref = tokenizer.decode(decode_greedy(model, state.logits, ref_cache,
                                             config.needle_tokens))
        reference.needles.append({"depth": depth, "found": answer_found(ref, key)})
        for codec, cut in actions:
            cache = reconstructed_cache(state.keys, state.values, codec_for(codec), cut,
                                        capacity, state.importance)
            # the first token comes from the suffix (or the head) in BF16: same logits as BF16's
            out = tokenizer.decode(decode_greedy(model, state.logits, cache, config.needle_tokens))
            tallies[codec, cut].needles.append({"depth": depth, "found": answer_found(out, key)})
        found = "found" if reference.needles[-1]["found"] else "missed"
        progress(f"passkey at depth {depth}: BF16 {found} it")


def _filler_repeats(tokenizer, target_tokens: int) -> int:
    per_repeat = len(tokenizer.encode(passkey_prompt(12345, 10))) - len(
        tokenizer.encode(passkey_prompt(12345, 0)))
    base = len(tokenizer.encode(passkey_prompt(12345, 0)))
    return max(0, (target_tokens - base) * 10 // max(1, per_repeat))


def _verdicts(model, actions, config, reference, tallies) -> Policy:
    ref_ppl = math.exp(reference.nll / reference.scored)
    verdicts, max_cut = [], {}
    for (codec, cut), t in tallies.items():
        ppl = math.exp(t.nll / t.scored)
        rise = ppl / ref_ppl - 1
        needles_ok = all(n["found"] or not r["found"] for n, r in zip(t.needles, reference.needles))
        reasons = []
        if t.first_agree < t.prompts:
            reasons.append(f"next-token top-1 differs on {t.prompts - t.first_agree} of "
                           f"{t.prompts} prompts")
        if rise > config.epsilon:
            reasons.append(f"perplexity rises {rise:.3%} > {config.epsilon:.0%}")
        if not needles_ok:
            reasons.append("misses a passkey BF16 finds")
        if t.generation is not None:
            reasons += config.floor.reasons(t.generation)
        verdicts.append({
            "codec": codec, "cut": cut, "eligible": not reasons, "reasons": reasons,
            "next_token_top1_agreement": t.first_agree / t.prompts,
            "next_token_kl": t.first_kl / t.prompts,
            "continuation_top1_agreement": t.all_agree / t.positions,
            "continuation_kl": t.all_kl / t.positions,
            "perplexity": ppl, "bf16_perplexity": ref_ppl, "perplexity_rise": rise,
            "needles": t.needles,
            "bytes_per_layer": t.payload_bytes / t.layers if t.layers else 0.0,
            "bf16_bytes_per_layer": model.shape.kv_layer_bytes(config.prompt_len),
            **(t.generation.to_json() if t.generation is not None else {})})
        if codec not in max_cut:
            max_cut[codec] = 0
    for codec in max_cut:
        cuts = sorted(v["cut"] for v in verdicts if v["codec"] == codec)
        passed = 0
        for cut in cuts:  # the largest cut below which every evaluated cut passed
            if not next(v for v in verdicts if v["codec"] == codec and v["cut"] == cut)[
                    "eligible"]:
                break
            passed = cut
        max_cut[codec] = passed
    return Policy(model=model.shape.name, prompt_len_range=(1, config.prompt_len),
                  max_cut=max_cut, epsilon=config.epsilon, verdicts=verdicts,
                  meta=PolicyMeta(prompt_len=config.prompt_len, prompts=config.prompts,
                                  continuation=config.continuation,
                                  needle_depths=tuple(config.needle_depths),
                                  bf16_needles=tuple(reference.needles),
                                  dtype=str(model.dtype),
                                  generation=_generation_record(config, tallies)))


def combine_regates(base: Policy, runs: Sequence[Policy]) -> Policy:
    """`base` with each codec that one of `runs` (`regate_generations` of `base`, each judging
    other codecs) judged taken from that run: its max cut, its verdicts and its record."""
    policy = Policy(base.model, base.prompt_len_range, dict(base.max_cut), base.epsilon,
                    list(base.verdicts), base.meta)
    record = None
    for run in runs:
        judged = set(run.meta.generation["codecs"]) if run.meta.generation else set()
        if judged & set(record["codecs"] if record else ()):
            raise ValueError(f"runs: more than one judged {sorted(judged & set(record['codecs']))}")
        policy.max_cut.update({c: run.max_cut[c] for c in judged})
        policy.verdicts = [run_v if v["codec"] in judged else v
                           for v, run_v in zip(policy.verdicts, run.verdicts)]
        if record is None:
            record = {**run.meta.generation, "codecs": {}, "runs": []}
        record["codecs"].update(run.meta.generation["codecs"])
        record["runs"].append({k: v for k, v in run.meta.generation.items() if k != "codecs"})
    policy.meta = base.meta.merged(PolicyMeta(generation=record))
    return policy


def _generation_record(config: GateConfig, tallies: dict) -> dict | None:
    scored = [t.generation for t in tallies.values() if t.generation is not None]
    if not scored:
        return None
    return {"tokens": config.generation_tokens, "floor": config.floor.to_json(),
            "prompts": [{"kind": kind} for kind in scored[0].kinds]}


def probe_spectrum(model: Model, tokenizer, context_len: int = PROBE_CONTEXT,
                   progress: Callable[[str], None] = lambda _: None) -> dict:
    """SpectrumKV's deployment probe (`eval.spectrum_probe`) on this model: passkey prompts of
    about `context_len` tokens, every layer's K and V through the 3-tier codec at the probe's
    budget with the prefill's own token importance, greedy answers from that cache."""

    def trial(t: NeedleTrial) -> str:
        codec = SpectrumCodec(t.budget, tiers=t.tiers)
        ids = tokenizer.encode(passkey_prompt(t.passkey, _filler_repeats(tokenizer, t.context_len),
                                              t.depth))
        state = prefill(model, ids, boundaries=(), importance_window=codec.importance_window)
        keys, values = [], []
        for k, v, scores in zip(state.keys, state.values, state.importance):
            k2, v2 = codec.decode(codec.encode(k, v, checksums=False,
                                               context=EncodeContext(scores)), verify=False)
            keys.append(k2.to(k.dtype))
            values.append(v2.to(v.dtype))
        cache = KVCache.from_layers(keys, values, len(ids) + PROBE_TOKENS)
        answer = tokenizer.decode(decode_greedy(model, state.logits, cache, PROBE_TOKENS))
        progress(f"spectrum probe at depth {t.depth}: {answer!r}")
        return answer

    return probe_int4_tolerance(trial, context_len=context_len)


def calibrate_splitzip(model: Model, text_ids: Sequence[int], prompt_len: int, prompts: int
                       ) -> dict:
    """SplitZip's exponent codebooks for this model: one ranked over the K and V of every layer,
    one over the boundary states h_c of every interior cut, each from `prompts` windows of the
    text taken from its end (away from the gate's evaluation windows at its start)."""
    kv, boundary = ExponentHistogram(), ExponentHistogram()
    L = model.shape.num_layers
    windows = text_windows(list(reversed(text_ids)), prompt_len, prompts)
    for window in windows:
        state = prefill(model, list(reversed(window)), boundaries=range(1, L))
        for k, v in zip(state.keys, state.values):
            kv.add(k.to(torch.bfloat16))
            kv.add(v.to(torch.bfloat16))
        for h in state.hidden.values():
            boundary.add(h.to(torch.bfloat16))
    return {"kv": kv.codebook(), "boundary": boundary.codebook(), "prompts": len(windows),
            "prompt_len": prompt_len}
