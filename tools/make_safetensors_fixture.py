#!/usr/bin/env python3
"""A safetensors file laid out exactly as the reference library (huggingface/safetensors) writes
it, built by hand from the published format, for tests/ckpt/test_safetensors_fixture.cpp.

The format (https://huggingface.co/docs/safetensors, and safetensors/src/tensor.rs `prepare`):
  * 8 bytes: N, the header length, unsigned little-endian;
  * N bytes: the JSON header, compact as serde_json prints it (no spaces), "__metadata__" first,
    then one entry per tensor {"dtype", "shape", "data_offsets": [begin, end]} in that key
    order, padded with spaces to a multiple of 8 bytes so the data block starts 8-aligned;
  * the data block: each tensor's bytes, little-endian, row-major, contiguous, no gaps, in the
    order the reference writer sorts them: by dtype alignment, largest first (the order of its
    Dtype enum: ... BF16 < I32 < U32 < F32 < C64 < F64 < I64 < U64), then by name.
Offsets are relative to the start of the data block.

Writes tests/fixtures/ckpt/reference_layout.safetensors (Python 3 standard library only; there
is no pip dependency, so the file can be regenerated anywhere):

    python3 tools/make_safetensors_fixture.py [--out tests/fixtures/ckpt]

The values are exact in their dtypes; the C++ test spells out the same values.
"""
import argparse
import json
import os
import struct

# name -> (dtype, shape, little-endian bytes), in the reference writer's order (see above).
TENSORS = [
    ("step", "I64", [], struct.pack("<q", 100)),  # a scalar: shape [], one element
    ("empty", "F32", [0], b""),  # zero elements: data_offsets [x, x]
    ("model.embed.weight", "F32", [2, 3],
     struct.pack("<6f", -1.0, -0.5, 0.0, 0.5, 1.0, 1.5)),
    ("tokens", "I32", [2, 2], struct.pack("<4i", 1, -2, 3, 70000)),
    # bf16 as raw bits: 1.0, -2.0, 0.5
    ("model.norm.weight", "BF16", [3], struct.pack("<3H", 0x3F80, 0xC000, 0x3F00)),
    ("mask", "BOOL", [4], bytes([1, 0, 1, 1])),
]
METADATA = {"format": "pt"}
SIZES = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "BOOL": 1}


def build():
    header = {"__metadata__": METADATA}
    data = b""
    for name, dtype, shape, raw in TENSORS:
        numel = 1
        for d in shape:
            numel *= d
        assert len(raw) == numel * SIZES[dtype], name
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "ckpt"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "reference_layout.safetensors")
    blob = build()
    with open(path, "wb") as f:
        f.write(blob)
    print(f"wrote {path}: {len(blob)} bytes")


if __name__ == "__main__":
    main()
