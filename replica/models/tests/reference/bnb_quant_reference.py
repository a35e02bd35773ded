#!/usr/bin/env python3
"""bitsandbytes' own quantization of a few tensors: the reference for replica/models/quant.h.

replica's NF4 (quantization: int4) and int8 (quantization: int8) formats claim to be
bitsandbytes' bit for bit: quantize_4bit(quant_type="nf4", blocksize=64) with and without
compress_statistics (QLoRA's double quantization: the absmax, less their mean, quantized
blockwise to bitsandbytes' 8-bit dynamic map in blocks of 256), and int8_vectorwise_quant
(LLM.int8()'s per-row absmax, threshold 0). This script writes what bitsandbytes computes, and
QuantBitsandbytes.* in replica/models/tests/quant_test.cpp requires replica to compute the
same codes, statistics and dequantized values.

bitsandbytes is not one of the project's dependencies (its QLoRA path is CUDA-first and replica
does not call it), so the fixture is committed. It was written with bitsandbytes 0.50.2 on CPU
(its C library for the dynamic-map step, the ATen reference ops for NF4 and int8) and torch
2.11 from the project's .venv:
    pip download bitsandbytes==0.50.2 --no-deps -d /tmp/bnb && unzip -q /tmp/bnb/*.whl -d /tmp/bnb/src
    PYTHONPATH=/tmp/bnb/src .venv/bin/python replica/models/tests/reference/bnb_quant_reference.py
It rewrites replica/models/tests/reference/bnb_quant.safetensors (or --out FILE) deterministically.

Tensors (names as in the file):
  a                  fp32 [64, 260]: N(0, 0.05) with exact zeros and a few outliers; 16640 values
                     = 260 NF4 blocks, so the double quantization has one full 256-block of
                     absmax and a partial one
  b                  bf16 [24, 40]: 15 blocks, a bf16 weight as loaded in bf16
  c                  fp32 [7, 9]: 63 values, an odd count and one partial NF4 block
  X.nf4.codes        uint8 [ceil(n/2)]  two codes per byte, the first in the high nibble
  X.nf4.absmax       fp32 [blocks]
  X.nf4.dequant      X's dtype          dequantize_4bit (b and c)
  a.nf4dq.absmax_codes  uint8 [blocks] (bitsandbytes' reference implementation: the nearest level);
                     a.nf4dq.absmax_codes_cpu_library (its CPU C library's search, which differs
                     on 3); a.nf4dq.absmax_absmax fp32 [2]; a.nf4dq.offset fp32 []
  a.nf4dq.dequant    fp32             (the 4-bit codes are a.nf4.codes: only the absmax change)
  X.int8.codes       int8 X's shape; X.int8.absmax fp32 [rows]; X.int8.dequant fp32 (b and c)
  dynamic_map        fp32 [256]       create_dynamic_map(signed=True)
  nf4_levels         fp32 [16]        get_4bit_type("nf4")
"""
import argparse
import os
import sys

import torch
from safetensors.torch import save_file

import bitsandbytes
import bitsandbytes.functional as F

sys.dont_write_bytecode = True


def inputs():
    g = torch.Generator().manual_seed(18)
    a = 0.05 * torch.randn(64, 260, generator=g)
    a[3, 10:40] = 0.0                      # exact zeros inside blocks
    a[5, 7] = 0.9                          # outliers: blocks whose absmax stands out
    a[40, 100] = -1.3
    b = (0.02 * torch.randn(24, 40, generator=g)).to(torch.bfloat16)
    c = torch.randn(7, 9, generator=g)
    return {"a": a, "b": b, "c": c}


def nf4(name, x, out, dequant):
    q, s = F.quantize_4bit(x, blocksize=64, compress_statistics=False, quant_type="nf4")
    out[name + ".nf4.codes"] = q.reshape(-1).contiguous()
    out[name + ".nf4.absmax"] = s.absmax.contiguous()
    if dequant:
        out[name + ".nf4.dequant"] = F.dequantize_4bit(q, s).contiguous()


def nf4_double(name, x, out):
    q, s = F.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert s.nested and s.state2.blocksize == 256
    assert torch.equal(q.reshape(-1), out[name + ".nf4.codes"])  # the 4-bit codes do not change
    # On CPU, quantize_4bit's dynamic-map step runs bitsandbytes' C library, whose code search
    # is not always the nearest level (here 3 of the 260 absmax get a neighbour, once one two
    # levels' gap farther away). bitsandbytes' reference implementation (backends/default,
    # the nearest level) is what replica computes; both are recorded.
    op = torch.ops.bitsandbytes.quantize_blockwise.default
    reference = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    absmax = out[name + ".nf4.absmax"]
    codes, absmax2 = op.redispatch(reference, absmax - s.offset, F.create_dynamic_map(), 256)
    assert torch.equal(absmax2, s.state2.absmax)
    out[name + ".nf4dq.absmax_codes_cpu_library"] = s.absmax.contiguous()
    s.absmax = codes
    out[name + ".nf4dq.absmax_codes"] = s.absmax.contiguous()
    out[name + ".nf4dq.absmax_absmax"] = s.state2.absmax.contiguous()
    out[name + ".nf4dq.offset"] = s.offset.reshape(()).float().contiguous()
    out[name + ".nf4dq.dequant"] = F.dequantize_4bit(q, s).contiguous()


def int8(name, x, out, dequant):
    codes, stats, outliers = F.int8_vectorwise_quant(x.clone(), threshold=0.0)
    assert outliers is None
    out[name + ".int8.codes"] = codes.contiguous()
    out[name + ".int8.absmax"] = stats.contiguous()
    if dequant:
        out[name + ".int8.dequant"] = F.int8_vectorwise_dequant(codes, stats).contiguous()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "bnb_quant.safetensors"))
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name, x in inputs().items():
        out[name] = x.contiguous()
        # The big tensor's single-level dequantized values are left out (the file stays small);
        # b's and c's cover them.
        nf4(name, x, out, dequant=name != "a")
        int8(name, x, out, dequant=name != "a")
    nf4_double("a", out["a"], out)
    out["dynamic_map"] = F.create_dynamic_map(signed=True).contiguous()
    out["nf4_levels"] = F.get_4bit_type("nf4", device="cpu").contiguous()
    save_file(out, args.out, metadata={"bitsandbytes": bitsandbytes.__version__, "torch": torch.__version__})
    print("wrote %s (bitsandbytes %s, torch %s)" % (args.out, bitsandbytes.__version__, torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main())
