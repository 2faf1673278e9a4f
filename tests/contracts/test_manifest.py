"""Folder manifests: safe paths, one canonical form, and every file checked against it."""

import json
import os
from pathlib import Path
from typing import Any

import pytest

from contracts.manifest import (
    ManifestError,
    ManifestFile,
    folder_verify,
    manifest_build,
    manifest_bytes,
    manifest_digest,
    manifest_parse,
    path_check,
)
from contracts.signing import signed_message, verify_signature
from tests.api.support import Signer, sha256_hex


def write_folder(root: Path, files: dict[str, bytes]) -> tuple[ManifestFile, ...]:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return manifest_build(
        ManifestFile(path=path, size=len(data), sha256=sha256_hex(data))
        for path, data in files.items()
    )


FILES = {
    "config.json": b'{"model_type": "bert"}',
    "model.safetensors": b"weights",
    "1_Pooling/config.json": b"{}",
}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("../config.json", "unsafe_path"),
        ("weights/../../etc/passwd.json", "unsafe_path"),
        ("/etc/config.json", "unsafe_path"),
        ("a\\b.json", "unsafe_path"),
        ("a//b.json", "unsafe_path"),
        ("a/./b.json", "unsafe_path"),
        ("", "unsafe_path"),
        ("we ird.json", "unsafe_path"),
        ("a/b/c/d/e/f.json", "unsafe_path"),
        ("x" * 300 + ".json", "unsafe_path"),
        ("modeling_evil.py", "file_type_not_allowed"),
        ("pytorch_model.bin", "file_type_not_allowed"),
        ("weights.pkl", "file_type_not_allowed"),
        ("run.sh", "file_type_not_allowed"),
    ],
)
def test_unsafe_paths_are_refused(raw: str, reason: str) -> None:
    with pytest.raises(ManifestError) as refused:
        path_check(raw)
    assert refused.value.reason == reason


def test_paths_are_normalised_and_safe_ones_kept() -> None:
    assert path_check("./config.json") == "config.json"
    assert path_check("1_Pooling/config.json") == "1_Pooling/config.json"
    assert path_check(".gitattributes") == ".gitattributes"


@pytest.mark.parametrize(
    "paths",
    [["config.json", "config.json"], ["Config.json", "config.json"], ["a.json", "a.json/b.json"]],
)
def test_a_path_appears_once(paths: list[str]) -> None:
    files = [ManifestFile(path=path, size=1, sha256="0" * 64) for path in paths]
    with pytest.raises(ManifestError) as refused:
        manifest_build(files)
    assert refused.value.reason == "duplicate_path"


def test_the_canonical_form_round_trips_and_nothing_else_parses() -> None:
    files = manifest_build(
        [
            ManifestFile(path="tokenizer.json", size=3, sha256="b" * 64),
            ManifestFile(path="config.json", size=2, sha256="a" * 64),
        ]
    )
    data = manifest_bytes(files)
    assert data == (
        b'{"files":[{"path":"config.json","sha256":"' + b"a" * 64 + b'","size":2},'
        b'{"path":"tokenizer.json","sha256":"' + b"b" * 64 + b'","size":3}]}'
    )
    assert manifest_parse(data) == files
    reordered = {"files": [file.to_json() for file in reversed(files)]}
    spaced = json.dumps({"files": [file.to_json() for file in files]}).encode()
    extra_key = json.dumps({"files": [], "note": 1}).encode()
    for variant in (json.dumps(reordered).encode(), spaced, extra_key, b"[]", b"{"):
        with pytest.raises(ManifestError):
            manifest_parse(variant)


def test_a_folder_matching_its_manifest_passes(tmp_path: Path) -> None:
    files = write_folder(tmp_path, FILES)
    folder_verify(tmp_path, files)


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda root: (root / "extra.json").write_bytes(b"{}"), "artifact_file_extra"),
        (lambda root: (root / "1_Pooling" / "config.json").unlink(), "artifact_file_missing"),
        (
            lambda root: (root / "config.json").write_bytes(b'{"model_type":"gpt"}'),
            "artifact_file_changed",
        ),
        (
            lambda root: (root / "model.safetensors").write_bytes(b"weightz"),
            "artifact_file_changed",
        ),
        (lambda root: os.symlink("/etc/passwd", root / "vocab.txt"), "artifact_file_unsafe"),
    ],
    ids=["extra", "missing", "resized", "changed", "symlink"],
)
def test_a_tampered_folder_is_refused_with_its_reason(tmp_path: Path, tamper, reason: str) -> None:
    files = write_folder(tmp_path, FILES)
    tamper(tmp_path)
    with pytest.raises(ManifestError) as refused:
        folder_verify(tmp_path, files)
    assert refused.value.reason == reason


def test_the_signature_covers_the_manifest_and_the_engine() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    signer = Signer("key", Ed25519PrivateKey.generate())
    files = manifest_build(
        [ManifestFile(path="config.json", size=2, sha256="a" * 64)],
    )
    digest = manifest_digest(files)
    config = {"dtype": "float32"}
    args = {"tensor_parallel_size": 2}
    signature = signer.sign(digest, config, engine="vllm", engine_args=args)
    verify_signature(
        public_key_b64=signer.public_key_b64,
        signature_b64=signature,
        digest=digest,
        serving_config=config,
        engine="vllm",
        engine_args=args,
    )
    other = manifest_digest(manifest_build([ManifestFile("config.json", 2, "c" * 64)]))
    changes: list[tuple[str, str, dict[str, Any]]] = [
        (other, "vllm", args),
        (digest, "sglang", args),
        (digest, "vllm", {"tensor_parallel_size": 4}),
    ]
    for signed_digest, engine, engine_args in changes:
        with pytest.raises(ValueError, match="does not match"):
            verify_signature(
                public_key_b64=signer.public_key_b64,
                signature_b64=signature,
                digest=signed_digest,
                serving_config=config,
                engine=engine,
                engine_args=engine_args,
            )
    # A built-in version without arguments signs what versions signed before engines.
    assert (
        signed_message(digest=digest, serving_config=config)
        == json.dumps(
            {"digest": digest, "serving_config": config}, sort_keys=True, separators=(",", ":")
        ).encode()
    )
