"""`ninfer inspect FILE [--verify] [--json]`: what a `.ninfer` file holds and whether it binds.

Prints identity, the registered package it binds to (or why not), its optional features (vision
tower, MTP layer, DFlash drafter: off, with the reason, for an artifact converted without their
weights), key dims, tensor count and bytes (total and per text/mtp/vision/dflash group), per-dtype
counts, frontend resources and provenance.
``--verify`` also reads every byte against its checksum (progress bar on stderr) and requires the
identity to bind; any failure exits 1 with a one-line message on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show what a .ninfer file holds; --verify checks every checksum")
    p.add_argument("file", help="path to a .ninfer artifact")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every tensor and resource checksum and that the identity binds (exit 1 if not)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact import Artifact, ArtifactError
    from ninfer.targets.registry import PackageMismatch

    try:
        with Artifact.open(args.file) as artifact:
            report = _report(artifact)
            if args.verify:
                if report["package"]["error"]:
                    raise ArtifactError(artifact.path, report["package"]["error"])
                artifact.verify(progress=True)
                report["verified"] = {
                    "tensors": report["tensors"]["count"],
                    "resources": len(report["frontend"]),
                }
    except (ArtifactError, PackageMismatch, OSError) as e:
        print(f"ninfer inspect: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    return 0


def _group(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("dflash."):
        return "dflash"
    if name.startswith("visual."):
        return "vision"
    return "text"


def _report(artifact: Any) -> dict[str, Any]:
    """Everything `inspect` shows, as JSON-able data (the text view renders this)."""
    from ninfer.artifact.format import DTYPE_NAMES
    from ninfer.targets.identity import IdentityMismatchError, check_identity

    package: dict[str, Any] = {
        "name": artifact.identity.get("package"),
        "description": None,
        "error": None,
        "features": None,
    }
    try:
        pkg = check_identity(artifact)
        package["description"] = pkg.description
        package["features"] = _features(pkg, artifact.provenance)
    except IdentityMismatchError as e:
        package["error"] = e.detail

    groups: dict[str, dict[str, int]] = {
        g: {"count": 0, "bytes": 0} for g in ("text", "mtp", "vision", "dflash")
    }
    dtypes: dict[str, dict[str, int]] = {}
    for d in artifact.descriptors():
        g = groups[_group(d.name)]
        g["count"] += 1
        g["bytes"] += d.nbytes
        dt = dtypes.setdefault(DTYPE_NAMES[d.dtype], {"count": 0, "bytes": 0})
        dt["count"] += 1
        dt["bytes"] += d.nbytes
    return {
        "path": artifact.path,
        "format_version": artifact.format_version,
        "file_bytes": artifact.file_bytes,
        "identity": artifact.identity,
        "package": package,
        "dims": artifact.dims,
        "tensors": {
            "count": len(artifact.descriptors()),
            "bytes": artifact.total_tensor_bytes,
            "groups": groups,
            "dtypes": dict(sorted(dtypes.items())),
        },
        "frontend": {
            r.name: {"nbytes": r.nbytes, "media_type": r.media_type} for r in artifact.frontend_descriptors()
        },
        "provenance": artifact.provenance,
    }


def _features(pkg: Any, provenance: dict[str, Any]) -> dict[str, Any]:
    """Which optional features the bound package has; for each one the artifact lacks, why (the
    converter's reason from the provenance, else the weights it has none of)."""
    from ninfer.targets.package import FEATURE_REFUSES, FEATURE_WEIGHTS

    reasons = provenance.get("features_off")
    reasons = reasons if isinstance(reasons, dict) else {}
    return {
        "vision": pkg.has_vision,
        "mtp": pkg.has_mtp,
        "dflash": pkg.has_dflash,
        "off": {
            f: f"{reasons.get(f, f'no {FEATURE_WEIGHTS[f]}')}: {FEATURE_REFUSES[f]}" for f in pkg.features_off
        },
    }


def human_bytes(n: int) -> str:
    """``1.50 GiB (1,610,612,736 B)``: binary units for reading, the exact count for comparing."""
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    short = f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
    return f"{short} ({n:,} B)" if unit != "B" else short


def _dims_lines(dims: dict[str, Any]) -> list[str]:
    """Key dims in words when they parse as the family's (`describe_dims`), else the raw top-level fields."""
    from ninfer.targets.registry import describe_dims

    lines = describe_dims(dims)
    if lines is None:
        return [", ".join(f"{k} {v}" for k, v in dims.items() if not isinstance(v, dict))]
    return lines


def _print_text(r: dict[str, Any]) -> None:
    ident, pkg, t = r["identity"], r["package"], r["tensors"]
    print(f"file        {r['path']}  (format version {r['format_version']}, {human_bytes(r['file_bytes'])})")
    print(
        f"identity    family {ident['family']}, package {ident['package']}, "
        f"storage profile {ident['storage_profile']}"
    )
    if pkg["error"]:
        print(f"package     does not bind: {pkg['error']}")
    else:
        features = pkg["features"]
        match = "dims match" if not features["off"] else "dims match without " + " and ".join(features["off"])
        print(f"package     {pkg['name']}: {pkg['description']} (registered, {match})")
        print(
            f"features    vision {'yes' if features['vision'] else 'no'}, "
            f"MTP {'yes' if features['mtp'] else 'no'}, "
            f"DFlash drafter {'yes' if features['dflash'] else 'no'}"
        )
        for why in features["off"].values():
            print(f"  off       {why}")
    for i, line in enumerate(_dims_lines(r["dims"])):
        print(f"{'dims' if i == 0 else '':<12}{line}")
    print(f"tensors     {t['count']} tensors, {human_bytes(t['bytes'])}")
    for name, g in t["groups"].items():
        if g["count"]:
            print(f"  {name:<10}{g['count']} tensors, {human_bytes(g['bytes'])}")
    print(
        "dtypes      "
        + ", ".join(f"{k} x{d['count']} ({human_bytes(d['bytes'])})" for k, d in t["dtypes"].items())
    )
    if r["frontend"]:
        print("frontend")
        for name, res in r["frontend"].items():
            print(f"  {name:<26}{human_bytes(res['nbytes']):<32}{res['media_type']}")
    else:
        print("frontend    (none)")
    provenance = json.dumps(r["provenance"], indent=2, sort_keys=True)
    print("provenance  " + provenance.replace("\n", "\n            "))
    if "verified" in r:
        print(f"verified {r['verified']['tensors']} tensors, {r['verified']['resources']} resources")
