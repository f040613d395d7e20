"""Units and byte widths shared by every layer of the core."""

MiB = 1 << 20
BF16_BYTES = 2  # one BF16 (or FP16) element: the boundary h_c, the head, BF16 KV, FP16 scales
TOKEN_ID_BYTES = 4  # token ids travel as int32
