#!/usr/bin/env python3
"""Reference data-pipeline indices and files for tests/data, made the way Megatron-LM makes them.

Transcribes Megatron-Core's index builders (megatron/core/datasets/gpt_dataset.py
_build_document_index / _build_shuffle_index / the epoch and final-epoch rules,
helpers.cpp build_sample_idx, build_blending_indices, build_exhaustive_blending_indices,
blended_megatron_dataset_config.py split parsing, utils.normalize, indexed_dataset.py
IndexedDatasetBuilder and tools/preprocess_data.py's per-document encoding) on top of the real
numpy RandomState / default_rng, which is what makes the shuffles bit-exact. numpy only.

Writes tests/fixtures/data/{indices.json, preprocess_*.{jsonl,bin,idx}}; the C++ tests compare
their indices and files with these element for element and byte for byte.
Usage: python3 tools/make_data_fixtures.py [--out tests/fixtures/data]
"""
import argparse
import functools
import json
import math
import os
import re
import struct

import numpy


# --- megatron/core/datasets/blended_megatron_dataset_config.py, utils.py ---------------------
def normalize(weights):
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def parse_and_normalize_split(split):
    split = list(map(float, re.findall(r"[.0-9]+", split)))
    split = split + [0.0 for _ in range(3 - len(split))]
    return normalize(split)


def split_matrix(vector):
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    bookends = list(zip(expansion[:-1], expansion[1:]))
    return [None if b[1] <= b[0] else (b[0], b[1]) for b in bookends]


def split_ranges(split, num_elements):
    out = []
    for s in split_matrix(parse_and_normalize_split(split)):
        if s is None:
            out.append(None)
        else:
            out.append([int(round(s[0] * float(num_elements))), int(round(s[1] * float(num_elements)))])
    return out


# --- gpt_dataset.py ------------------------------------------------------------------------
def num_epochs_for(tokens_per_epoch, num_samples, seq_length):
    if num_samples is None:
        return 1
    epochs, tokens = 1, tokens_per_epoch
    while tokens < num_samples * seq_length + 1:
        epochs += 1
        tokens += tokens_per_epoch
    return epochs


def build_document_index(documents, num_epochs, rng, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        idx = numpy.mgrid[0:num_epochs, 0:len(documents)][1]
        idx[:] = documents
        idx = idx.reshape(-1).astype(numpy.int32)
        rng.shuffle(idx)
        return idx
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return numpy.concatenate((first, last))


def build_shuffle_index(num_samples, total_size, rng):
    dtype_ = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, 1, dtype=dtype_)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, 1, dtype=dtype_)
    rng.shuffle(last)
    return numpy.concatenate((first, last))


def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """helpers.cpp build_sample_idx, drop_last_partial_sequence, add_extra_token_to_sequence=1."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = [[0, 0]]
    d, off = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                if d == len(doc_idx) - 1:
                    assert len(out) == num_samples
                    off = int(sizes[doc_idx[d]]) - 1
                    break
                d += 1
                off = 0
        out.append([d, off])
    return out


def gpt_indices(sizes, begin, end, num_samples, seq_length, seed):
    documents = numpy.arange(begin, end, dtype=numpy.int32)
    tokens_per_epoch = int(numpy.sum(numpy.asarray(sizes)[documents]))
    epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    if epochs == 1:
        separate = False
    else:
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= from_final <= per_epoch + 1
        separate = from_final < int(0.80 * per_epoch)
    rng = numpy.random.RandomState(seed)
    doc_idx = build_document_index(documents, epochs, rng, separate)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens_per_epoch)
    total = len(sample_idx) - 1
    shuffle_idx = build_shuffle_index(sans_final if separate else total, total, rng)
    return {
        "tokens_per_epoch": tokens_per_epoch, "num_epochs": epochs,
        "separate_final_epoch": bool(separate),
        "document_index": doc_idx.tolist(), "sample_index": sample_idx,
        "shuffle_index": [int(x) for x in shuffle_idx],
    }


def sample_tokens(tokens_of, idx, i, seq_length):
    """GPTDataset._query_document_sample_shuffle_indices: the seq_length + 1 tokens of sample i."""
    j = idx["shuffle_index"][i]
    (b, b_off), (e, e_off) = idx["sample_index"][j], idx["sample_index"][j + 1]
    parts = []
    for d in range(b, e + 1):
        seq = tokens_of(idx["document_index"][d])
        lo = b_off if d == b else 0
        hi = e_off + 1 if d == e else len(seq)
        parts.extend(seq[lo:hi])
    assert len(parts) == seq_length + 1
    return parts


# --- helpers.cpp blending ------------------------------------------------------------------
def blending(weights, size):
    current = [0] * len(weights)
    di, dsi = [], []
    for i in range(size):
        at = max(float(i), 1.0)
        best, best_err = 0, weights[0] * at - current[0]
        for d in range(1, len(weights)):
            err = weights[d] * at - current[d]
            if err > best_err:
                best, best_err = d, err
        di.append(best)
        dsi.append(current[best])
        current[best] += 1
    return di, dsi


def exhaustive_blending(sizes):
    total = sum(sizes)
    weights = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = sorted(i for i in range(len(sizes)) if sizes[i] > 0)
    di, dsi, i = [], [], 0
    while unspent:
        at = max(float(i), 1.0)
        best, best_err = -1, -math.inf
        for d in unspent:
            err = weights[d] * at - counts[d]
            if err > best_err:
                best, best_err = d, err
        di.append(best)
        dsi.append(counts[best])
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
        i += 1
    return di, dsi


# --- indexed_dataset.py IndexedDatasetBuilder + tools/preprocess_data.py -------------------
def optimal_dtype(vocab_size):
    return numpy.uint16 if vocab_size is not None and vocab_size < 65500 else numpy.int32


DTYPE_CODES = {numpy.uint8: 1, numpy.int8: 2, numpy.int16: 3, numpy.int32: 4, numpy.int64: 5,
               numpy.float64: 6, numpy.float32: 7, numpy.uint16: 8}


def write_indexed(prefix, documents, dtype):
    """documents: list of (token ids, sequence lengths), as preprocess_data.py's add_document."""
    lengths, doc_idx = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for ids, lens in documents:
            f.write(numpy.array(ids, dtype=dtype).tobytes(order="C"))
            lengths.extend(lens)
            doc_idx.append(len(lengths))
    item = numpy.dtype(dtype).itemsize
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * item
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(numpy.array(lengths, dtype=numpy.int32).tobytes(order="C"))
        f.write(numpy.array(pointers, dtype=numpy.int64).tobytes(order="C"))
        f.write(numpy.array(doc_idx, dtype=numpy.int64).tobytes(order="C"))


def encode_document(text, tokenize, eod, append_eod):
    """Encoder.encode for one json key without sentence splitting."""
    sentences = text if isinstance(text, list) else [text]
    doc_ids, lens = [], []
    for s in sentences:
        ids = tokenize(s)
        if len(ids) > 0:
            doc_ids.extend(ids)
            lens.append(len(ids))
    if len(doc_ids) > 0 and append_eod:
        doc_ids.append(eod)
        lens[-1] += 1
    return doc_ids, lens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "data"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # Sequence lengths with zero-length and one-token sequences among them.
    sizes = numpy.random.RandomState(3).randint(0, 40, size=60).astype(numpy.int32).tolist()
    sizes[5] = 1
    sizes[6] = 0
    cases = []
    for seed in (1234, 7):
        for seq_length, num_samples, split in ((16, None, "1,0,0"), (16, 200, "969, 30, 1"),
                                               (8, 300, "90,5,5"), (13, 137, "1,0,0"),
                                               (16, 95, "1,0,0"), (5, 40, "2,1,1")):
            begin, end = split_ranges(split, len(sizes))[0]
            idx = gpt_indices(sizes, begin, end, num_samples, seq_length, seed)
            idx.update({"seed": seed, "seq_length": seq_length, "num_samples": num_samples,
                        "split": split, "doc_begin": begin, "doc_end": end})
            cases.append(idx)
    splits = []
    for split, n in (("969, 30, 1", 1000), ("969, 30, 1", 37), ("90,5,5", 10), ("2,1,1", 10),
                     ("1,1,1", 100000), ("99,1", 7), ("100,0,0", 5), ("0.5 0.25 0.25", 6)):
        splits.append({"split": split, "num_elements": n, "ranges": split_ranges(split, n)})
    blends = []
    for weights, size in (([0.3, 0.7], 50), ([1, 2, 3], 61), ([5.5, 0.25, 1, 1, 2], 97)):
        w = normalize(weights)
        di, dsi = blending(w, size)
        blends.append({"weights": weights, "normalized": [x.hex() for x in w], "size": size,
                       "dataset_index": di, "dataset_sample_index": dsi})
    rs = numpy.random.RandomState(11)
    many = (rs.rand(13) * 10).tolist()
    blends.append({"weights": many, "normalized": [x.hex() for x in normalize(many)], "size": 0,
                   "dataset_index": [], "dataset_sample_index": []})
    exhaustive = []
    for s in ([5, 3, 7], [1, 0, 4, 2]):
        di, dsi = exhaustive_blending(s)
        exhaustive.append({"sizes": s, "dataset_index": di, "dataset_sample_index": dsi})

    # --mock-data: Megatron's MockGPTLowLevelDataset lengths and the first samples of its train
    # split (vocab 1000, eod 999, seq_length 32, 64 samples, seed 1234).
    mock_lengths = numpy.random.default_rng(seed=0).integers(low=1, high=4096, size=100000,
                                                              dtype=numpy.int32)
    begin, end = split_ranges("1,1,1", 100000)[0]
    midx = gpt_indices(mock_lengths, begin, end, 64, 32, 1234)

    def mock_tokens(i):
        n = int(mock_lengths[i])
        return [int(x) for x in (numpy.arange(n - 1) + 1) % 1000] + [999]

    mock = {"first_lengths": mock_lengths[:32].tolist(), "sum_lengths": int(mock_lengths.sum()),
            "train_documents": [begin, end], "num_epochs": midx["num_epochs"],
            "document_index_head": midx["document_index"][:32],
            "num_samples": len(midx["shuffle_index"]),
            "shuffle_index_head": midx["shuffle_index"][:64],
            "first_samples": [sample_tokens(mock_tokens, midx, i, 32) for i in range(4)]}

    # preprocess_data.py on a small JSON-lines file (unicode, an empty document, a list-valued
    # text) with the byte-level and the Null tokenizer.
    docs = ["Hello, world!", "", "Ünïcödé ✓ and more text", "a" * 70, ["two ", "sentences"],
            "line one\nline two"]
    with open(os.path.join(args.out, "preprocess_input.jsonl"), "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "other": "x"}) + "\n")
    enc = [encode_document(d, lambda s: list(s.encode("utf-8")), 0, True) for d in docs]
    write_indexed(os.path.join(args.out, "preprocess_bytelevel_text_document"), enc,
                  optimal_dtype(256))
    # (An empty text is an error for the NullTokenizer, as int('') is in Python.)
    null_docs = ["1 2 3", "40000 5", "7", ["8 9", "10"]]
    with open(os.path.join(args.out, "preprocess_null.jsonl"), "w", encoding="utf-8") as f:
        for d in null_docs:
            f.write(json.dumps({"text": d}) + "\n")
    enc = [encode_document(d, lambda s: [int(x) for x in s.split(" ")], 69999, True)
           for d in null_docs]
    write_indexed(os.path.join(args.out, "preprocess_null_text_document"), enc,
                  optimal_dtype(70000))

    with open(os.path.join(args.out, "indices.json"), "w") as f:
        json.dump({"sizes": sizes, "gpt": cases, "splits": splits, "blends": blends,
                   "exhaustive_blends": exhaustive, "mock": mock}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
