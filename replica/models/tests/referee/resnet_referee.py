"""Referee for replica's ResNet-18: torchvision.models.resnet18.

Usage: resnet_referee.py MANIFEST.json

MANIFEST.json is a list of cases {"name", "weights", "batch", "in_channels", "stem"}:
  weights  a safetensors file replica wrote (its ResNet-18's parameters and buffers),
  batch    a safetensors file with "x" (the input batch) and "logits" (replica's eval-mode
           output on it).
For each case the referee builds torchvision.models.resnet18(num_classes=N) (N from fc.bias),
adapted to the case's stem exactly as replica documents the mapping:
  imagenet, 3 channels: torchvision's model unchanged (the same architecture),
  imagenet, C channels: conv1 = Conv2d(C, 64, 7, stride 2, padding 3, bias=False),
  pooled:               conv1 = Conv2d(C, 64, 3, stride 1, padding 1, bias=False),
  small:                the pooled conv1 and maxpool = Identity,
loads the weights with load_state_dict(strict=True) after checking that every tensor has the
dtype of torchvision's own state_dict entry, and compares its eval-mode output on x with
replica's logits (max abs diff <= 1e-4). Prints one line per case; exits 1 on any failure.
"""
import json
import sys

import torch
import torchvision
from safetensors.torch import load_file


def build(num_classes, in_channels, stem):
    model = torchvision.models.resnet18(num_classes=num_classes)
    if stem == "imagenet":
        if in_channels != 3:
            model.conv1 = torch.nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    elif stem in ("pooled", "small"):
        model.conv1 = torch.nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        if stem == "small":
            model.maxpool = torch.nn.Identity()
    else:
        raise ValueError(f"unknown stem {stem!r}")
    return model


def check(case):
    weights = load_file(case["weights"])
    batch = load_file(case["batch"])
    model = build(int(weights["fc.bias"].shape[0]), case["in_channels"], case["stem"])
    reference = model.state_dict()
    problems = []
    for name, tensor in weights.items():
        if name in reference and tensor.dtype != reference[name].dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, torchvision has {reference[name].dtype}")
    if problems:
        return False, "; ".join(problems)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        return False, f"load_state_dict(strict=True) failed: {e}"
    model.eval()
    with torch.no_grad():
        out = model(batch["x"])
    theirs = batch["logits"]
    if out.shape != theirs.shape:
        return False, f"output shape {tuple(out.shape)} != replica's {tuple(theirs.shape)}"
    diff = (out - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    ok = diff <= 1e-4 and torch.isfinite(out).all().item()
    return ok, f"{len(weights)} tensors loaded strict, max abs diff {diff:.3g} (logits up to {scale:.3g})"


def main() -> int:
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    failed = 0
    for case in cases:
        ok, message = check(case)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {case['name']}: {message}")
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
