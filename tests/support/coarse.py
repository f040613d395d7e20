"""`with_coarse(codec_for)`: a codec lookup that also knows `coarse`, int8's wire fed K and V at
five levels (`services.prefill.faults.CoarseCodec`): an action that fails the quality gate on
every CPU, where a real lossy codec's verdict rests on that CPU's roundings."""

from services.prefill.faults import CoarseCodec


def with_coarse(codec_for):
    return lambda name: CoarseCodec(codec_for("int8")) if name == "coarse" else codec_for(name)
