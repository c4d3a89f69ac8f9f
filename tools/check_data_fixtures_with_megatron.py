#!/usr/bin/env python3
"""Checks the committed data fixtures (tests/fixtures/data, written by make_data_fixtures.py,
numpy only) against megatron-core itself: the preprocess outputs against its
IndexedDatasetBuilder, the GPT document / sample / shuffle indices against
gpt_dataset._build_document_index, helpers_cpp.build_sample_idx and _build_shuffle_index, and
the weighted blends against helpers_cpp.build_blending_indices.

Needs megatron-core (and torch) from PyPI:  pip install megatron-core torch numpy
    python3 tools/check_data_fixtures_with_megatron.py      # exit 0: every fixture is Megatron's
"""
import importlib.util
import json
import os
import sys
import tempfile

import numpy
from megatron.core.datasets import gpt_dataset
from megatron.core.datasets import helpers_cpp
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "data")
spec = importlib.util.spec_from_file_location(
    "make_data_fixtures", os.path.join(ROOT, "tools", "make_data_fixtures.py"))
mdf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mdf)


def check_preprocess(out):
    ok = True
    cases = [("preprocess_bytelevel_text_document", "preprocess_input.jsonl",
              lambda s: list(s.encode("utf-8")), 0, 256),
             ("preprocess_null_text_document", "preprocess_null.jsonl",
              lambda s: [int(x) for x in s.split(" ")], 69999, 70000)]
    for name, jsonl, tokenize, eod, vocab in cases:
        dtype = mdf.optimal_dtype(vocab)
        builder = IndexedDatasetBuilder(os.path.join(out, name + ".bin"), dtype=dtype)
        for line in open(os.path.join(FIXTURES, jsonl), encoding="utf-8"):
            ids, lens = mdf.encode_document(json.loads(line)["text"], tokenize, eod, True)
            builder.add_document(numpy.array(ids, dtype=dtype), lens)  # preprocess_data.py's call
        builder.finalize(os.path.join(out, name + ".idx"))
        for ext in (".bin", ".idx"):
            with open(os.path.join(out, name + ext), "rb") as a, \
                    open(os.path.join(FIXTURES, name + ext), "rb") as b:
                same = a.read() == b.read()
            print(f"{name}{ext}: {'equals' if same else 'DIFFERS FROM'} megatron-core's builder")
            ok &= same
    return ok


def check_gpt_indices():
    d = json.load(open(os.path.join(FIXTURES, "indices.json")))
    sizes = numpy.array(d["sizes"], dtype=numpy.int32)
    bad = 0
    for c in d["gpt"]:
        rs = numpy.random.RandomState(c["seed"])
        docs = numpy.arange(c["doc_begin"], c["doc_end"], dtype=numpy.int32)
        doc_idx = gpt_dataset._build_document_index(docs, c["num_epochs"], rs,
                                                    c["separate_final_epoch"])
        # drop_last_partial_sequence=True, add_extra_token_to_sequence=1: Megatron's defaults.
        sample_idx = helpers_cpp.build_sample_idx_int32(sizes, doc_idx, c["seq_length"],
                                                        c["num_epochs"], c["tokens_per_epoch"],
                                                        True, 1)
        n = sample_idx.shape[0] - 1
        if c["separate_final_epoch"]:
            first = ((c["num_epochs"] - 1) * c["tokens_per_epoch"] - 1) // c["seq_length"]
            shuffle = gpt_dataset._build_shuffle_index(first, n, rs)
        else:
            shuffle = gpt_dataset._build_shuffle_index(n, n, rs)
        same = (doc_idx.tolist() == c["document_index"] and
                sample_idx.tolist() == c["sample_index"] and shuffle.tolist() == c["shuffle_index"])
        if not same:
            bad += 1
            print(f"GPT indices seed {c['seed']} seq {c['seq_length']} split {c['split']}: DIFFER")
    print(f"GPT indices: {len(d['gpt']) - bad} of {len(d['gpt'])} cases equal megatron-core's")
    return bad == 0


def check_blends():
    d = json.load(open(os.path.join(FIXTURES, "indices.json")))
    bad = 0
    for b in d["blends"]:
        w = numpy.array([float.fromhex(x) for x in b["normalized"]], dtype=numpy.float64)
        di = numpy.zeros(b["size"], dtype=numpy.int16)
        dsi = numpy.zeros(b["size"], dtype=numpy.int64)
        helpers_cpp.build_blending_indices(di, dsi, w, len(w), b["size"], False)
        if di.tolist() != b["dataset_index"] or dsi.tolist() != b["dataset_sample_index"]:
            bad += 1
            print(f"blend {b['weights']} size {b['size']}: DIFFERS")
    print(f"blends: {len(d['blends']) - bad} of {len(d['blends'])} equal megatron-core's")
    return bad == 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        ok = check_preprocess(out)
    ok &= check_gpt_indices()
    ok &= check_blends()
    sys.exit(0 if ok else 1)
