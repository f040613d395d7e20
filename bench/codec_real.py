"""bench/codecs.py's real-data section: compression ratios on the KV cache and on the boundary
hidden states a real model produces from real text.

`real_section(model, measured, calibration)` prefills the model on token windows and reports
- for every registered codec, on the K and V of every layer of the `measured` windows: BF16 bytes /
  payload bytes (headers excluded), per layer and over all; lossless codecs' round trips checked bit
  for bit, lossy codecs' relative error ‖x̂ − x‖ / ‖x‖ for K and for V; spectrum codecs get the
  prefill's own token importance. SplitZip three times: its registered form (the codebook ranked
  from the layer's own K and V, `per-tensor`) and with a fixed codebook calibrated (an
  `ExponentHistogram`) on the KV (`kv`) or on the boundary states (`boundary`) of the
  `calibration` windows, never the measured ones;
- SplitZip on the boundary states h_c of every interior c (0 < c < L; `[S, d]` each) under the
  same three codebooks (`per-tensor`: each h_c's own), with escape rates and round-trip checks.

`load_embedded(text)` gives the embedded model (SmolLM2-135M, BF16) and the text's token ids;
`split_windows` spreads measured and calibration windows over them, disjoint.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from rekv_core.codecs import EncodeContext, SplitZipCodec, codec_names, get_codec
from rekv_core.codecs.splitzip import decode_bf16, encode_bf16
from rekv_core.kernels import ExponentHistogram
from rekv_core.model import DEFAULT_MODEL, Model, embedded_gguf_path, load_weights, prefill
from rekv_core.plan.gate import text_windows

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
CODEBOOKS = ("per-tensor", "kv", "boundary")


def embedded_available(text: Path) -> bool:
    try:
        embedded_gguf_path()
    except FileNotFoundError:
        return False
    return Path(text).is_file()


def load_embedded(text: Path, dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cpu") -> tuple[Model, list[int]]:
    from rekv_core.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    ids = tokenizer.encode(Path(text).read_text(encoding="utf-8"))
    return Model(load_weights(DEFAULT_MODEL, dtype, device)), ids


def split_windows(ids: Sequence[int], length: int, measured: int, calibration: int
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """`measured + calibration` windows of `length` tokens spread evenly over `ids`; the
    calibration ones interleaved among them, so both sets sample the whole text."""
    windows = text_windows(ids, length, measured + calibration)
    every = len(windows) / max(calibration, 1)
    picked = {int(i * every + every / 2) for i in range(calibration)}
    return ([w for i, w in enumerate(windows) if i not in picked],
            [w for i, w in enumerate(windows) if i in picked])


def _interior(model: Model) -> list[int]:
    return list(range(1, model.shape.num_layers))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def calibrate(model: Model, windows: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """SplitZip codebooks from the calibration windows: one ranked on every layer's K and V, one on
    every interior boundary state."""
    kv, hidden = ExponentHistogram(), ExponentHistogram()
    for ids in windows:
        out = prefill(model, ids, boundaries=_interior(model))
        for k, v in zip(out.keys, out.values):
            kv.add(k).add(v)
        for h in out.hidden.values():
            hidden.add(h)
    return {"kv": kv.codebook(), "boundary": hidden.codebook()}


class _Tally:
    """Bytes, escapes and errors of one (codec, codebook) over layers or boundaries, windows."""

    def __init__(self, codec: str, codebook: str | None, lossless: bool):
        self.codec, self.codebook, self.lossless = codec, codebook, lossless
        self.input = self.payload = self.elements = self.escapes = 0
        self.exact = True
        self.err2, self.norm2 = [0.0, 0.0], [0.0, 0.0]
        self.per: dict[int, list[int]] = {}  # layer or boundary -> [input, payload]

    def add(self, index: int, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
            payload: int, escapes: int | None = None) -> None:
        size = sum(x.numel() for x in inputs)
        self.input += 2 * size
        self.payload += payload
        self.elements += size
        self.escapes += escapes or 0
        per = self.per.setdefault(index, [0, 0])
        per[0] += 2 * size
        per[1] += payload
        for i, (x, y) in enumerate(zip(inputs, outputs)):
            if self.lossless:
                self.exact &= _same_bits(x, y.reshape(x.shape))
            x = x.float()
            self.err2[i] += float((y.reshape(x.shape).float() - x).square().sum())
            self.norm2[i] += float(x.square().sum())

    def row(self, index_name: str, escapes: bool) -> dict:
        row = {"codec": self.codec, "codebook": self.codebook, "input_bytes": self.input,
               "payload_bytes": self.payload, "ratio": self.input / self.payload,
               "lossless": self.lossless, "exact": self.exact if self.lossless else None,
               "escape_rate": self.escapes / self.elements if escapes else None,
               f"{index_name}_ratios": {str(i): a / b for i, (a, b) in sorted(self.per.items())}}
        names = ("k", "v") if index_name == "layer" else ("h",)
        for name, err2, norm2 in zip(names, self.err2, self.norm2):
            row[f"{name}_rel_err"] = (err2 / norm2) ** 0.5 if norm2 else 0.0
        return row


def _kv_codecs(codebooks: dict[str, list[int]]) -> list[tuple[_Tally, object]]:
    out = []
    for name in codec_names():
        codec = get_codec(name)
        label = "per-tensor" if name == "splitzip" else None
        out.append((_Tally(name, label, codec.lossless), codec))
    for label in ("kv", "boundary"):
        out.append((_Tally("splitzip", label, True), SplitZipCodec(codebook=codebooks[label])))
    return out


def _measure_kv(out, tallies) -> None:
    for layer, (k, v) in enumerate(zip(out.keys, out.values)):
        for tally, codec in tallies:
            context = (EncodeContext(out.importance[layer]) if codec.importance_window
                       else EncodeContext())
            encoded = codec.encode(k, v, checksums=False, context=context)
            k2, v2 = codec.decode(encoded, verify=False)
            escapes = encoded.meta["escapes"] if tally.codec == "splitzip" else None
            tally.add(layer, (k, v), (k2, v2), encoded.payload_bytes,
                      None if escapes is None else escapes["k"] + escapes["v"])


def _measure_boundary(out, codebooks, tallies: dict[str, _Tally]) -> None:
    for c, h in sorted(out.hidden.items()):
        for label, tally in tallies.items():
            codebook = codebooks.get(label) or ExponentHistogram().add(h).codebook()
            buffers, meta = encode_bf16(h, codebook)
            restored = decode_bf16(buffers, meta)
            tally.add(c, (h,), (restored,), sum(b.numel() for b in buffers.values()),
                      meta["escapes"])


def real_section(model: Model, measured: Sequence[Sequence[int]],
                 calibration: Sequence[Sequence[int]],
                 progress: Callable[[str], None] = lambda _: None) -> dict:
    """Compression of every codec on the measured windows' KV, and of SplitZip on their boundary
    states, with codebooks calibrated on the other windows (module docstring)."""
    window = max(get_codec(name).importance_window for name in codec_names())
    codebooks = calibrate(model, calibration)
    progress(f"calibrated on {len(calibration)} windows: kv {codebooks['kv']}, "
             f"boundary {codebooks['boundary']}")
    kv = _kv_codecs(codebooks)
    boundary = {label: _Tally("splitzip", label, True) for label in CODEBOOKS}
    for number, ids in enumerate(measured, 1):
        out = prefill(model, ids, boundaries=_interior(model), importance_window=window)
        _measure_kv(out, kv)
        _measure_boundary(out, codebooks, boundary)
        progress(f"window {number}/{len(measured)} measured")
    return {"model": model.shape.name, "dtype": str(model.dtype).removeprefix("torch."),
            "window_tokens": len(measured[0]), "windows": len(measured),
            "calibration_windows": len(calibration), "importance_window": window,
            "layers": model.shape.num_layers, "boundaries": _interior(model),
            "codebooks": codebooks,
            "kv": [t.row("layer", t.codec == "splitzip") for t, _ in kv],
            "boundary": [t.row("boundary", True) for t in boundary.values()]}


def run_real(text: Path, tokens: int, windows: int, calibration: int,
             device: torch.device | str = "cpu") -> dict:
    def progress(message: str) -> None:
        print(f"[real] {message}", file=sys.stderr, flush=True)

    model, ids = load_embedded(text, device=device)
    measured, calib = split_windows(ids, tokens, windows, calibration)
    progress(f"{len(ids)} tokens of {text}; {windows} windows of {tokens} measured, "
             f"{calibration} for calibration")
    return {"text": str(text), **real_section(model, measured, calib, progress)}


def print_real(real: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"Compression on real data: {real['model']} {real['dtype']}, "
                        f"{real['windows']} WikiText windows of {real['window_tokens']} tokens "
                        f"(codebooks calibrated on {real['calibration_windows']} others)")
    for column in ("data", "codec", "codebook", "ratio", "min/max per layer", "escapes",
                   "round trip / rel. err K, V"):
        table.add_column(column, justify="left" if column in ("data", "codec", "codebook")
                         else "right")
    for data, rows, key in (("KV", real["kv"], "layer_ratios"),
                            ("h_c", real["boundary"], "boundary_ratios")):
        for r in rows:
            ratios = r[key].values()
            escapes = "" if r["escape_rate"] is None else f"{r['escape_rate']:.3%}"
            check = ("exact" if r["exact"] else "NOT EXACT") if r["lossless"] else (
                f"{r['k_rel_err']:.4f}, {r['v_rel_err']:.4f}")
            table.add_row(data, r["codec"], r["codebook"] or "", f"{r['ratio']:.4f}x",
                          f"{min(ratios):.3f} / {max(ratios):.3f}", escapes, check)
    console.print(table)
    console.print(f"codebooks: kv {real['codebooks']['kv']}; boundary "
                  f"{real['codebooks']['boundary']}")
