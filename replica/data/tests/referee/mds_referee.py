"""Referee for replica's MDS shards: mosaicml-streaming itself.

Usage:
  mds_referee.py read SPEC.json
      SPEC.json: {"datasets": [{"dir", "samples": [SAMPLE, ...], "twin": bool}]}, datasets replica
      wrote. Each is read with streaming.StreamingDataset(local=dir) (no remote, no shuffle):
      the sample count and every column's value must equal SAMPLE ("read": false skips this).
      With "twin", the samples are written again by streaming.MDSWriter with the columns,
      compression and size_limit of replica's index.json, and every shard must be byte for
      byte what replica wrote (the decompressed bytes, for zstd shards) and index.json the same
      JSON (compressed sizes aside).
  mds_referee.py write ROOT
      Writes data sets with streaming.MDSWriter under ROOT (every encoding replica reads, with
      and without compression, several shards) and ROOT/spec.json in the SPEC form above.

Values in a SAMPLE (JSON): integers and floats as numbers ("nan", "inf", "-inf" as strings);
str as a string; bytes as {"hex": ...}; json as the JSON text; ndarray as {"dtype", "shape",
"data": flat values in C order}.
Prints a summary; exits 1 naming every difference.
"""
import json
import math
import os
import random
import shutil
import sys
import tempfile

import numpy as np

INT_ENCODINGS = {"int8", "int16", "int32", "int64", "int", "uint8", "uint16", "uint32", "uint64"}
FLOAT_ENCODINGS = {"float32", "float64"}
ND_DTYPES = ["uint8", "int8", "uint16", "int16", "float16", "uint32", "int32", "float32", "uint64", "int64",
             "float64"]


def float_value(v):
    if isinstance(v, str):
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[v]
    return float(v)


def float_json(v):
    v = float(v)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def to_python(encoding, v):
    """The value MDSWriter takes for a SAMPLE value."""
    if encoding in INT_ENCODINGS:
        return int(v)
    if encoding in FLOAT_ENCODINGS:
        return float_value(v)
    if encoding == "str":
        return v
    if encoding == "bytes":
        return bytes.fromhex(v["hex"])
    if encoding == "json":
        return json.loads(v)
    if encoding.startswith("ndarray"):
        data = [float_value(x) if isinstance(x, str) else x for x in v["data"]]
        return np.array(data, dtype=v["dtype"]).reshape(v["shape"])
    raise ValueError(f"encoding {encoding}")


def to_json(encoding, v):
    """The SAMPLE value of a value streaming decoded."""
    if encoding in INT_ENCODINGS:
        return int(v)
    if encoding in FLOAT_ENCODINGS:
        return float_json(v)
    if encoding == "str":
        return v
    if encoding == "bytes":
        return {"hex": v.hex()}
    if encoding == "json":
        return json.dumps(v)
    if encoding.startswith("ndarray"):
        flat = v.reshape(-1)
        data = [float_json(x) for x in flat.tolist()] if v.dtype.kind == "f" else [int(x) for x in flat.tolist()]
        return {"dtype": v.dtype.name, "shape": list(v.shape), "data": data}
    raise ValueError(f"encoding {encoding}")


def same(encoding, got, want):
    """Does the decoded value `got` equal the SAMPLE value `want`?"""
    if encoding in INT_ENCODINGS:
        return isinstance(got, (int, np.integer)) and int(got) == want
    if encoding in FLOAT_ENCODINGS:
        w = float_value(want)
        g = float(got)
        return (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) == math.copysign(1, w))
    if encoding == "str":
        return isinstance(got, str) and got == want
    if encoding == "bytes":
        return isinstance(got, bytes) and got == bytes.fromhex(want["hex"])
    if encoding == "json":
        return got == json.loads(want)
    if encoding.startswith("ndarray"):
        if not isinstance(got, np.ndarray) or got.dtype.name != want["dtype"] or list(got.shape) != want["shape"]:
            return False
        w = to_python(encoding, want)
        return got.tobytes() == w.tobytes()
    raise ValueError(f"encoding {encoding}")


def index_columns(directory):
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    shard = index["shards"][0]
    return index, dict(zip(shard["column_names"], shard["column_encodings"]))


def read_one(ds_spec, problems):
    from streaming import StreamingDataset
    directory = ds_spec["dir"]
    index, columns = index_columns(directory)
    # StreamingDataset decompresses zstd shards into its local directory: read a copy, so that
    # the directory replica wrote stays as it was for the twin comparison.
    work = tempfile.mkdtemp(prefix="mds-referee-")
    local = os.path.join(work, "ds")
    shutil.copytree(directory, local)
    try:
        ds = StreamingDataset(local=local, shuffle=False, batch_size=1)
        want = ds_spec["samples"]
        if len(ds) != len(want):
            problems.append(f"{directory}: StreamingDataset has {len(ds)} samples, replica wrote {len(want)}")
            return
        for i, w in enumerate(want):
            got = ds[i]
            if sorted(got) != sorted(w):
                problems.append(f"{directory}[{i}]: columns {sorted(got)} != {sorted(w)}")
                continue
            for name, value in w.items():
                if not same(columns[name], got[name], value):
                    problems.append(f"{directory}[{i}].{name} ({columns[name]}): streaming read "
                                    f"{to_json(columns[name], got[name])!r}, replica wrote {value!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return index, columns


def twin(ds_spec, index, columns, problems):
    """Writes the samples again with MDSWriter; the files must be replica's."""
    from streaming import MDSWriter
    from streaming.base.compression import decompress
    directory = ds_spec["dir"]
    shard0 = index["shards"][0]
    work = tempfile.mkdtemp(prefix="mds-twin-")
    try:
        out = os.path.join(work, "ds")
        with MDSWriter(out=out, columns=columns, compression=shard0["compression"],
                       size_limit=shard0["size_limit"]) as writer:
            for s in ds_spec["samples"]:
                writer.write({name: to_python(columns[name], v) for name, v in s.items()})
        with open(os.path.join(out, "index.json")) as f:
            theirs = json.load(f)

        def without_zip_bytes(ix):
            shards = json.loads(json.dumps(ix["shards"]))
            for sh in shards:
                if sh.get("zip_data"):
                    sh["zip_data"].pop("bytes", None)
            return {"version": ix["version"], "shards": shards}

        if without_zip_bytes(index) != without_zip_bytes(theirs):
            def shards(ix):
                return [(sh["samples"], sh["raw_data"]["bytes"]) for sh in ix["shards"]]
            if shards(index) != shards(theirs):
                problems.append(f"{directory}: shards (samples, bytes) {shards(index)}, MDSWriter's {shards(theirs)} "
                                f"(size_limit {shard0['size_limit']})")
            else:
                problems.append(f"{directory}: index.json differs from MDSWriter's:\n  replica {json.dumps(index)}\n"
                                f"  MDSWriter {json.dumps(theirs)}")
            return
        for sh in theirs["shards"]:
            def raw(d, info):
                if sh["zip_data"]:
                    with open(os.path.join(d, info["zip_data"]["basename"]), "rb") as f:
                        return decompress(sh["compression"], f.read())
                with open(os.path.join(d, info["raw_data"]["basename"]), "rb") as f:
                    return f.read()
            mine = raw(directory, sh)
            ref = raw(out, sh)
            if mine != ref:
                at = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
                problems.append(f"{directory}/{sh['raw_data']['basename']}: differs from MDSWriter's at byte {at} "
                                f"({len(mine)} vs {len(ref)} bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def read(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    problems = []
    samples = 0
    twins = 0
    read_sets = 0
    for ds_spec in spec["datasets"]:
        before = len(problems)
        if ds_spec.get("read", True):
            result = read_one(ds_spec, problems)
            samples += len(ds_spec["samples"])
            read_sets += 1
        else:
            result = index_columns(ds_spec["dir"])
        if result and ds_spec.get("twin") and len(problems) == before:
            twin(ds_spec, *result, problems)
            twins += 1
    if problems:
        print("\n".join(problems[:40]))
        print(f"{len(problems)} differences")
        return 1
    import streaming
    print(f"mosaicml-streaming {streaming.__version__}: {read_sets} replica data sets read by StreamingDataset, "
          f"{samples} samples equal; {twins} of {len(spec['datasets'])} written byte-identically by MDSWriter")
    return 0


# ---------------------------------------------------------------------------------------------
# write

def random_array(rng, dtype, shape):
    n = int(np.prod(shape))
    if dtype.startswith("float"):
        data = rng.normal(size=n) * 100
        return data.astype(dtype).reshape(shape)
    info = np.iinfo(dtype)
    values = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
    return values.reshape(shape)


def write(root):
    from streaming import MDSWriter
    rng = np.random.default_rng(1234)
    pyrng = random.Random(99)
    columns = {
        "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "iint": "int",
        "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
        "f32": "float32", "f64": "float64", "s": "str", "b": "bytes", "j": "json",
        "nd": "ndarray",
    }
    for dt in ND_DTYPES:
        columns[f"nd_{dt}"] = f"ndarray:{dt}"
        columns[f"nd_{dt}_fixed"] = f"ndarray:{dt}:2,3"
    extremes = {"int8": (-2**7, 2**7 - 1), "int16": (-2**15, 2**15 - 1), "int32": (-2**31, 2**31 - 1),
                "int64": (-2**63, 2**63 - 1), "int": (-2**63, 2**63 - 1), "uint8": (0, 2**8 - 1),
                "uint16": (0, 2**16 - 1), "uint32": (0, 2**32 - 1), "uint64": (0, 2**63 - 1)}
    floats = [0.0, -0.0, 1.5, -3.25, 1e-30, 1e30, math.inf, -math.inf, math.nan]

    def sample(i):
        s = {}
        for name, enc in columns.items():
            if enc in extremes:
                lo, hi = extremes[enc]
                s[name] = [lo, hi, 0][i] if i < 3 else pyrng.randint(lo, hi)
            elif enc == "float32":
                s[name] = float(np.float32(floats[i % len(floats)] if i < len(floats) else rng.normal() * 1e3))
            elif enc == "float64":
                s[name] = floats[i % len(floats)] if i < len(floats) else float(rng.normal() * 1e6)
            elif enc == "str":
                s[name] = ["", "plain", "ünïcödé ✓ 日本語", "line\nbreak\ttab \"quoted\""][i % 4] + "x" * (i % 7)
            elif enc == "bytes":
                s[name] = bytes(rng.integers(0, 256, size=i % 11, dtype=np.uint8)) + b"\x00\xff"
            elif enc == "json":
                s[name] = {"id": i, "tags": ["a", "ü"][: i % 3], "score": i / 4, "nested": {"ok": i % 2 == 0},
                           "none": None}
            elif enc == "ndarray":
                dt = ND_DTYPES[i % len(ND_DTYPES)]
                shape = [(1,), (3,), (2, 3), (300,), (2, 1, 2)][i % 5]
                s[name] = random_array(rng, dt, shape)
            elif enc.startswith("ndarray:"):
                parts = enc.split(":")
                shape = (2, 3) if len(parts) == 3 else [(4,), (1, 2), (2, 2, 2)][i % 3]
                s[name] = random_array(rng, parts[1], shape)
        return s

    samples = [sample(i) for i in range(24)]
    spec = {"datasets": []}
    for name, compression, size_limit in [("plain", None, 4096), ("zstd", "zstd", 4096), ("zstd7", "zstd:7", None)]:
        out = os.path.join(root, name)
        with MDSWriter(out=out, columns=columns, compression=compression, size_limit=size_limit) as writer:
            for s in samples:
                writer.write(s)
        spec["datasets"].append({"dir": out, "compression": compression,
                                 "samples": [{k: to_json(columns[k], v) for k, v in s.items()} for s in samples]})
    with open(os.path.join(root, "spec.json"), "w") as f:
        json.dump(spec, f)
    shards = [len([f for f in os.listdir(os.path.join(root, d)) if f.startswith("shard.")])
              for d in ("plain", "zstd", "zstd7")]
    print(f"MDSWriter: {len(samples)} samples x {len(columns)} columns in 3 data sets ({shards} shards)")
    return 0


def main() -> int:
    if sys.argv[1] == "read":
        return read(sys.argv[2])
    if sys.argv[1] == "write":
        return write(sys.argv[2])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
