"""What integrity and encryption of the data plane cost on host buffers, in GB/s beside this
machine's memory-copy rate and the rate of the link they protect.

    python bench/seal.py [--sizes 1,16,64] [--repeats 15] [--warmups 2] [--threads N]
                         [--link-gbps 10] [--json bench/results/seal-cpu.json]

For each size S in --sizes (MiB): one message (`rekv_core.transport.Message`) holding one buffer
of S random bytes and a `with_checksums` header, and these cases, each on the CPU:

- copy: `dst.copy_(src)` between two preallocated S-byte tensors: the ceiling. torch may copy
  with several threads, every other case runs on one: `--threads 1` compares like with like.
- checksum: `checksums` with `default_algorithm(cpu)` (crc32), as the data plane computes it.
- mac, poly1305: the bulk MAC of a host buffer (`bulk_mac.buffer_tags`): the one-time key's
  HMAC and Poly1305 over the bytes.
- mac, poly61 reference: the device MAC's PyTorch reference on the CPU, what a CPU receiver
  pays to verify a GPU sender's message (the Triton kernel is measured by bench/gpu).
- seal / open: `seal` and `open_message` of the message: the MAC over the bytes (Poly1305) and
  the HMAC over header and tags, what each side pays per message.
- seal, sizes only: `seal` with `Protection.SIZES` (the probe's): the HMAC over the header alone,
  a cost per message (µs, no GB/s), whatever S is.
- encrypt / decrypt: `encrypt` and `decrypt` of the message: HKDF, a new output tensor and
  AES-256-GCM over the buffer.
- aes-gcm, preallocated: `AESGCM.encrypt_into` into a preallocated tensor (cryptography >= 47):
  the cipher alone, without key derivation or the first touch of a new tensor's pages.
- new tensor, first touch: `torch.empty` of S bytes and one write per 4 KiB page: what encrypt
  and decrypt pay for their output tensor beyond the cipher (page faults, where the allocator
  maps fresh memory: glibc does for blocks above its mmap threshold, at most 32 MiB).

Timing: --warmups untimed calls of each case, then --repeats rounds; each round times every case
once, in order on even rounds and in reverse order on odd ones, so that drift in the machine
(clock frequency, other load) spreads over all cases. A sample lasts at least 1 ms: a faster case
runs that many calls in a row and the time is divided by them. Reported: the median seconds per
call, GB/s = S / median (the bytes of the plaintext, counted once), its fraction of the copy rate
at the same S, its multiple of the link's rate (--link-gbps, default 10 Gb/s: above 1 the case
keeps up with the link on this one core), and µs per message.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rekv_cli.bench.machine import machine_info
from rekv_cli.bench.provenance import provenance
from rekv_cli.util import csv_of, write_json
from rekv_core.codecs.checksum import checksums, default_algorithm
from rekv_core.handoff.bulk_mac import Protection, buffer_tags
from rekv_core.handoff.seal import decrypt, encrypt, new_key, open_message, seal, with_checksums
from rekv_core.transport import Message

# what the figures measure (`provenance`): the seal, the bulk MACs and the checksum on host buffers
MEASURES = ("rekv_core/handoff/seal.py", "rekv_core/handoff/bulk_mac.py",
            "rekv_core/codecs/checksum.py", "rekv_core/kernels/checksum_reference.py",
            "rekv_core/kernels/checksum_triton.py", "rekv_core/kernels/polymac_reference.py",
            "rekv_core/kernels/polymac_triton.py", "bench/seal.py")

MIN_SAMPLE_S = 1e-3
PAGE = 4096
PER_MESSAGE = ("seal, sizes only",)  # header-only: no GB/s
CPU = torch.device("cpu")


def cases(size: int) -> dict:
    """name -> a call doing that case once on a buffer of `size` bytes."""
    g = torch.Generator().manual_seed(size)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    dst = torch.empty_like(src).fill_(0)
    key, algorithm = new_key(), default_algorithm(CPU)
    buffers = {"kv": src}
    header = with_checksums(buffers)

    def message(head: bytes = header) -> Message:
        return Message("bench", 7, "layer.0", head, buffers)

    sealed_header = seal(key, message()).header
    encrypted = encrypt(key, message())
    found = {
        "copy": lambda: dst.copy_(src),
        "checksum": lambda: checksums(buffers, algorithm),
        "mac, poly1305": lambda: buffer_tags(key, message(), Protection.POLY1305),
        "mac, poly61 reference": lambda: buffer_tags(key, message(), Protection.POLY61),
        "seal": lambda: seal(key, message()),
        "open": lambda: open_message(key, message(sealed_header)),
        "seal, sizes only": lambda: seal(key, message(), Protection.SIZES),
        "encrypt": lambda: encrypt(key, message()),
        "decrypt": lambda: decrypt(key, encrypted),
    }
    aead, out = AESGCM(new_key()), torch.empty(size + 16, dtype=torch.uint8)
    if hasattr(aead, "encrypt_into"):
        nonce, plain, written = bytes(12), src.numpy(), out.numpy()
        found["aes-gcm, preallocated"] = lambda: aead.encrypt_into(nonce, plain, b"", written)
    found["new tensor, first touch"] = lambda: torch.empty(size, dtype=torch.uint8)[::PAGE].fill_(0)
    return found


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(size: int, repeats: int, warmups: int, link_gbps: float) -> list[dict]:
    todo = cases(size)
    calls = {}
    for name, fn in todo.items():
        for _ in range(warmups):
            fn()
        calls[name] = max(1, math.ceil(MIN_SAMPLE_S / per_call(fn, 1)))
    samples = {name: [] for name in todo}
    order = list(todo)
    for round_ in range(repeats):
        for name in order if round_ % 2 == 0 else order[::-1]:
            samples[name].append(per_call(todo[name], calls[name]))
    copy_s = statistics.median(samples["copy"])
    rows = []
    for name, seconds in samples.items():
        median = statistics.median(seconds)
        bulk = name not in PER_MESSAGE
        rows.append({"size_bytes": size, "case": name, "median_s": median,
                     "us_per_message": median * 1e6,
                     "gbps": size / median / 1e9 if bulk else None,
                     "fraction_of_copy": copy_s / median if bulk else None,
                     "times_link": size * 8 / median / (link_gbps * 1e9) if bulk else None,
                     "calls_per_sample": calls[name], "min_s": min(seconds),
                     "max_s": max(seconds)})
    return rows


def run(args: argparse.Namespace) -> dict:
    started = provenance(measures=MEASURES)
    rows = [row for mib in args.sizes
            for row in measure(mib << 20, args.repeats, args.warmups, args.link_gbps)]
    return {
        "machine": {**machine_info(CPU, torch.uint8, torch.get_num_threads()), **started},
        "command": " ".join(["python", *sys.argv]),
        "cryptography": version("cryptography"),
        "encrypt_into": hasattr(AESGCM, "encrypt_into"),
        "sizes_mib": args.sizes, "repeats": args.repeats, "warmups": args.warmups,
        "link_gbps": args.link_gbps,
        "min_sample_s": MIN_SAMPLE_S,
        "rows": rows,
    }


def print_table(result: dict) -> None:
    m = result["machine"]
    print(f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch "
          f"{m['torch']}, cryptography {result['cryptography']}, commit {m['commit']}")
    print()
    link = f"{result['link_gbps']:g} Gb/s"
    print(f"| MiB | case | µs per message | GB/s | of copy | × {link} link |")
    print("|----:|:-----|---------------:|-----:|--------:|-----------:|")
    for r in result["rows"]:
        gbps, fraction, times = ((f"{r['gbps']:,.2f}", f"{r['fraction_of_copy']:.1%}",
                                  f"{r['times_link']:,.2f}")
                                 if r["gbps"] is not None else ("–", "–", "–"))
        print(f"| {r['size_bytes'] >> 20} | {r['case']} | {r['us_per_message']:,.1f} | {gbps} | "
              f"{fraction} | {times} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=csv_of(int), default=[1, 16, 64],
                        help="buffer sizes in MiB, comma-separated (default 1,16,64)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed calls per case")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--link-gbps", type=float, default=10.0,
                        help="the link the seal protects, Gb/s (default 10)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if not args.sizes or min(args.sizes) < 1:
        parser.error("--sizes: need one or more positive sizes in MiB")
    if args.link_gbps <= 0:
        parser.error("--link-gbps: must be positive")
    if args.repeats < 1 or args.warmups < 0:
        parser.error("--repeats: must be positive; --warmups: must not be negative")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads: must be positive")
        torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
