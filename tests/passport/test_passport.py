"""The checkpoint passport (issue 38): attest a real FSDP2 DCP checkpoint with a key, copy it to ``s3://`` (the suite's
moto server) and to another folder, verify both; a flipped byte names its file and tensor; the real model-signing
verifier accepts the untouched copy and rejects the flipped one; a hand-edited passport is refused by ``--key``.

Run: ``.venv/bin/python -m pytest -q tests/passport/test_passport.py``
"""

from __future__ import annotations

import base64
import io
import json
import os
import pathlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptaudit.cli import main
from ckptaudit.ondisk.passport import PASSPORT_NAME, SIGNATURE_NAME, is_passport_name, passport_path
from ckptaudit.passport import PassportError, attest, read_passport, verify
from ckptaudit.passport.digests import digest_files, list_files, root_digest

ec = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.ec")
model_signing = pytest.importorskip("model_signing")


def _keys(where: Path) -> tuple[str, str]:
    """A fresh EC P-256 key pair (PEM files): the user's own, as model-signing's ``sign key`` takes it."""
    from cryptography.hazmat.primitives import serialization as ser

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where / "key.pem", where / "key.pub"
    private.write_bytes(key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))
    return str(private), str(public)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _model_signing_verify(path: Path, public: str) -> None:
    """The real model-signing verifier (its Python API; ``model_signing verify key`` calls the same)."""
    import model_signing.verifying

    sig = path / SIGNATURE_NAME if path.is_dir() else Path(str(path) + ".passport.sig")
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(path, sig)


@pytest.fixture(scope="module")
def signed(fsdp_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The FSDP2 run's DCP checkpoint (saved the documented way), attested with a key through the command line."""
    work = tmp_path_factory.mktemp("passport")
    ckpt = work / "step-6"
    shutil.copytree(Path(fsdp_run["dir"]) / "faithful", ckpt)
    private, public = _keys(work)
    code, out, err = _cli("attest", str(ckpt), "--key", private)
    assert code == 0, out + err
    assert "signed by sha256:" in out and PASSPORT_NAME in out
    return {"ckpt": ckpt, "private": private, "public": public, "work": work}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def test_attest_copy_verify_flip(signed: dict[str, Any], tmp_path: Path) -> None:
    """The issue's done-when, end to end."""
    ckpt, public = signed["ckpt"], signed["public"]
    assert (ckpt / PASSPORT_NAME).is_file() and (ckpt / SIGNATURE_NAME).is_file()
    p = read_passport(str(ckpt / PASSPORT_NAME))
    assert p.signed and p.verdict == "pass" and p.artifact == "training" and p.tensors
    assert {f.name for f in p.files} == {n for n, _, _ in list_files(str(ckpt))}
    assert not any(is_passport_name(f.name) for f in p.files)

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)  # cp -r carries the passport inside
    code, out, err = _cli("verify", str(copy), "--key", public)
    assert code == 0, out + err
    assert out.startswith("VERIFIED")
    _model_signing_verify(copy, public)  # model-signing accepts the file digests of the passport

    from local_s3 import local_s3

    with local_s3("passports") as s3:
        fs = s3.fs
        fs.put(str(ckpt), "passports/step-6", recursive=True)  # aws s3 sync carries it too
        code, out, err = _cli("verify", "s3://passports/step-6/", "--key", public)
        assert code == 0, out + err
        # A byte changed in the bucket: the remote verify reads every byte and names the file.
        data = max((n for n in os.listdir(ckpt) if n.endswith(".distcp")), key=lambda n: (ckpt / n).stat().st_size)
        flipped = bytearray((ckpt / data).read_bytes())
        flipped[len(flipped) // 2] ^= 1
        fs.pipe(f"passports/step-6/{data}", bytes(flipped))
        type(fs).clear_instance_cache()  # the first verify's client holds a listing of the old ETags
        code, out, err = _cli("verify", "s3://passports/step-6/", "--key", public)
        assert code == 1 and f"{data}: its bytes differ" in out, out + err

    # One byte of one data file flipped, in the middle of the largest tensor's bytes: exit 1, the file and the tensor.
    _flip(copy / data, (copy / data).stat().st_size // 2)
    result = verify(str(copy), key=public)
    assert not result.ok and result.changed == (data,) and not result.missing and not result.extra
    assert len(result.changed_tensors) == 1, result.changed_tensors
    code, out, err = _cli("verify", str(copy), "--key", public)
    assert code == 1 and f"{data}: its bytes differ" in out and result.changed_tensors[0] in out, out
    with pytest.raises(ValueError, match="Signature mismatch"):
        _model_signing_verify(copy, public)  # and model-signing rejects the flipped copy


def _edit_audit(passport: Path, change: Any) -> None:
    """Edit the audit statement inside a passport by hand (decode, change, encode: what anyone can do)."""
    doc = json.loads(passport.read_text())
    env = doc["audit"]["dsseEnvelope"]
    stmt = json.loads(base64.b64decode(env["payload"]))
    change(stmt["predicate"])
    env["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    passport.write_text(json.dumps(doc))


def test_a_hand_edited_passport_is_refused_by_key(signed: dict[str, Any], tmp_path: Path,
                                                  fsdp_run: dict[str, Any]) -> None:
    # A failing checkpoint attested digest-only, its verdict edited to a pass: without a key that cannot be told,
    # with one it is refused (nothing unsigned is trusted).
    bad = tmp_path / "rounded.pt"
    shutil.copy(Path(fsdp_run["dir"]) / "compute-copy-bf16.pt", bad)
    code, out, _ = _cli("attest", str(bad))
    assert code == 1 and "digest-only" in out and "verdict: fail" in out
    assert verify(str(bad)).findings[-1].code == "passport.verdict"
    _edit_audit(Path(passport_path(str(bad))), lambda p: p.update(verdict="pass", findings={}))
    assert verify(str(bad)).ok  # digest-only proves nothing about who wrote it: verify without --key says so
    code, out, _ = _cli("verify", str(bad), "--key", signed["public"])
    assert code == 1 and "passport.signature" in out and "digest-only" in out, out
    # A signed passport edited by hand: the signature no longer verifies.
    copy = tmp_path / "copy"
    shutil.copytree(signed["ckpt"], copy)
    _edit_audit(copy / PASSPORT_NAME, lambda p: p.update(verdict="pass", summary="edited"))
    result = verify(str(copy), key=signed["public"])
    assert not result.ok and result.signature == "failed"
    assert "does not verify with the key given" in result.findings[0].message
    # Another key's public half: refused by its hint before any signature is checked.
    _, other = _keys(tmp_path)
    code, out, _ = _cli("verify", str(signed["ckpt"]), "--key", other)
    assert code == 1 and "another key" in out


def test_same_tensors_other_files(signed: dict[str, Any], tmp_path: Path) -> None:
    """A DCP folder consolidated into one torch.save: other files, the same tensors (by their digests)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    one = tmp_path / "consolidated.pt"
    dcp_to_torch_save(str(signed["ckpt"]), str(one))
    result = verify(str(one), str(signed["ckpt"] / PASSPORT_NAME), key=signed["public"])
    assert not result.ok and result.same_tensors is True and result.missing and result.extra == (".",)
    assert any(f.code == "passport.same-tensors" and "same tensors, other files" in f.message
               for f in result.findings)


def test_expect_serving_refuses_a_training_passport(signed: dict[str, Any]) -> None:
    result = verify(str(signed["ckpt"]), key=signed["public"], expect="serving")
    assert not result.ok and [f.code for f in result.findings] == ["passport.verdict"]


@pytest.mark.parametrize(("text", "says"), [
    ("{", "not valid JSON"),
    ('{"passport_version": 99}', "passport_version 99"),
    ("[" * 5000 + "]" * 5000, "nests deeper"),
    ('{"passport_version": 1, "signed": false, "model_signing": {}, "audit": {}}', "not a DSSE envelope"),
    ('{"passport_version": 1, "passport_version": 1}', "appears twice"),
])
def test_a_malformed_passport_is_one_line_and_exit_2(signed: dict[str, Any], tmp_path: Path, text: str,
                                                     says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    code, out, err = _cli("verify", str(signed["ckpt"]), "--passport", str(bad))
    assert code == 2 and not out and says in err and err.count("\n") == 1, err


def test_a_passport_over_the_cap_is_not_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptaudit.passport.document as document

    monkeypatch.setattr(document, "MAX_PASSPORT_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(" " * 2000)
    with pytest.raises(PassportError, match=r"limit|more than"):
        read_passport(str(big))


def test_missing_passport_and_a_key_that_does_not_load(signed: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "m.bin").write_bytes(b"x")
    code, out, _ = _cli("verify", str(tmp_path / "m.bin"))
    assert code == 1 and "passport.missing" in out
    code, _, err = _cli("verify", str(signed["ckpt"]), "--key", signed["private"])
    assert code == 2 and "PEM public key" in err


def test_our_file_digests_are_model_signings(tmp_path: Path) -> None:
    """The serialization model-signing's verifier wants: names, order (``a/b`` before ``a.b``, unlike string
    order), root digest, and the git paths it always leaves out."""
    import model_signing.hashing
    from model_signing._signing import signing as ms_signing

    d = tmp_path / "m"
    (d / "a").mkdir(parents=True)
    (d / "a" / "b").write_bytes(b"1")
    (d / "a.b").write_bytes(b"2")
    (d / "z").write_bytes(os.urandom(3 << 20))
    (d / ".gitignore").write_text("x")
    (d / PASSPORT_NAME).write_text("{}")
    for algorithm in ("sha256", "blake3"):
        ours = digest_files(list_files(str(d)), algorithm, jobs=2)
        config = model_signing.hashing.Config().use_file_serialization(hashing_algorithm=algorithm)
        theirs = config.set_ignored_paths(paths=[PASSPORT_NAME]).hash(pathlib.Path(d))
        assert [(f.name, f.digest) for f in sorted(ours, key=lambda f: f.name.split("/"))] == [
            (r.identifier, r.digest.digest_hex) for r in theirs.resource_descriptors()]
        subject = ms_signing.Payload(theirs).statement.pb.subject[0]
        assert root_digest(ours) == "sha256:" + dict(subject.digest)["sha256"]


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[Path]:
    import torch

    d = tmp_path / "tiny"
    d.mkdir()
    torch.save({"model": {"w": torch.randn(8, 8)}}, d / "model.pt")
    yield d


def test_a_file_changed_while_attested_is_refused(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptaudit.passport.digests as digests

    real = digests.digest_files

    def and_then_write(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        with open(tiny / "model.pt", "ab") as fh:
            fh.write(b"late")
        return out

    monkeypatch.setattr(digests, "digest_files", and_then_write)
    with pytest.raises(PassportError, match="changed while it was attested"):
        attest(str(tiny))


def test_export_serving_writes_a_signed_passport_naming_its_source(signed: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "serving"
    code, _, err = _cli("export-serving", str(signed["ckpt"]), "--recipe", "ckptaudit.recipes.tinygpt:recipe",
                        "--out", str(out), "--passport-key", signed["private"], "--no-progress", "--format", "json")
    assert code == 0, err
    p = read_passport(str(out / PASSPORT_NAME))
    source = read_passport(str(signed["ckpt"] / PASSPORT_NAME))
    assert p.signed and p.artifact == "serving" and p.verdict == "pass" and p.serving is not None
    assert p.serving.source_passport_digest == source.digest and p.serving.gate["passed"] is True
    code, out_text, _ = _cli("verify", str(out), "--expect", "serving", "--key", signed["public"])
    assert code == 0, out_text
    _model_signing_verify(out, signed["public"])
    code, out_text, _ = _cli("verify", str(out), "--key", signed["public"])  # used as a training checkpoint
    assert code == 1 and "attested as a serving export, used as training" in out_text


def test_the_passport_and_its_predicate_follow_the_shipped_schema(signed: dict[str, Any], tiny: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from ckptaudit.schema import SCHEMA_PATH

    schema = json.loads(Path(SCHEMA_PATH).with_name("passport.schema.json").read_text())
    for path in (signed["ckpt"] / PASSPORT_NAME, Path(attest(str(tiny)).file or "")):
        doc = json.loads(path.read_text())
        jsonschema.validate(doc, schema)
        stmt = json.loads(base64.b64decode(doc["audit"]["dsseEnvelope"]["payload"]))
        jsonschema.validate(stmt["predicate"], {"$defs": schema["$defs"], "$ref": "#/$defs/predicate"})
        assert stmt["predicateType"] == "https://ckptaudit.dev/passport/v1"


def test_tensor_digests_are_of_the_values_whatever_the_layout(tmp_path: Path) -> None:
    """A transposed view saved with its strides (read through iter_chunks) and its contiguous copy (hashed where
    it lies) have one digest; one value changed, another."""
    import torch

    from ckptaudit.auditing.plan import plan_scan
    from ckptaudit.passport.digests import tensor_digests

    base = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    changed = base.t().contiguous()
    changed[7, 11] += 1
    digests = []
    for name, t in (("strided", base.t()), ("contiguous", base.t().contiguous()), ("changed", changed)):
        torch.save({"w": t}, tmp_path / f"{name}.pt")
        plan = plan_scan(str(tmp_path / f"{name}.pt"))
        try:
            got, errors = tensor_digests([item[0] for item in plan.items], plan.ckpt.maps, jobs=2)
        finally:
            plan.close()
        assert not errors and len(got) == 1 and got[0].shape == (200, 300)
        digests.append(got[0].digest)
    assert digests[0] == digests[1] != digests[2]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*prefix, 0))


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _set(doc[path[0]], path[1:], value)
    return doc


def test_a_mangled_passport_is_a_finding_or_one_error_never_a_crash(tiny: Path) -> None:
    """Every field of both statements (and of the file) replaced by a value of every other JSON type: verify
    returns a result or raises PassportError (the command line's exit 2), nothing else."""
    attest(str(tiny))
    file = tiny / PASSPORT_NAME
    original = json.loads(file.read_text())
    tried = 0
    for part in ("model_signing", "audit", None):
        stmt = json.loads(base64.b64decode(original[part]["dsseEnvelope"]["payload"])) if part else original
        for path in list(_paths(stmt))[1:]:
            for value in (None, 1, -1, "x", [], {}, True, 1.5):
                doc = json.loads(json.dumps(original))
                if part:
                    changed = _set(json.loads(json.dumps(stmt)), path, value)
                    doc[part]["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(changed).encode()).decode()
                else:
                    doc = _set(doc, path, value)
                file.write_text(json.dumps(doc))
                try:
                    verify(str(tiny))
                except PassportError:
                    pass
                tried += 1
    assert tried > 300


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_model_signing_verifies_a_signed_passport_of_either_digest(tiny: Path, algorithm: str) -> None:
    private, public = _keys(tiny.parent)
    p = attest(str(tiny), key=private, algorithm=algorithm)
    assert p.algorithm == algorithm and p.signed
    _model_signing_verify(tiny, public)
    one = attest(str(tiny / "model.pt"), key=private, algorithm=algorithm)  # a single file: its passport beside it
    assert [f.name for f in one.files] == ["."]
    _model_signing_verify(tiny / "model.pt", public)
    intact = verify(str(tiny / "model.pt"), key=public)  # the tiny checkpoint has no optimizer: verdict fail
    assert intact.signature == "verified" and not intact.changed and intact.findings[-1].code == "passport.verdict"
    _flip(tiny / "model.pt", 200)
    with pytest.raises(ValueError, match="Signature mismatch"):
        _model_signing_verify(tiny / "model.pt", public)
    assert verify(str(tiny / "model.pt"), key=public).changed == (".",)


def test_attest_and_verify_do_not_import_torch(tiny: Path) -> None:
    import subprocess
    import sys

    code = ("import sys\nfrom ckptaudit.passport import attest, verify\n"
            f"attest({str(tiny)!r}); verify({str(tiny)!r})\nprint('torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stderr[-2000:]
