"""Hub ids → local model directories, without network: a cache laid out as huggingface_hub writes it
(offline mode), and a loopback HTTP server standing in for the Hub through HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lmserve import LLM, SamplingParams
from lmserve.checkpoint.hub import is_repo_id, resolve_model_path
from tests.hf_reference import hf_greedy

COMMIT = "a" * 40
COMMIT_V1 = "b" * 40


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF hub cache that huggingface_hub (already imported) uses for this test."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def lay_out_cache(cache: Path, repo_id: str, model_dir: Path, commit: str, ref: str = "main") -> Path:
    """What snapshot_download leaves behind: blobs/<etag>, snapshots/<commit>/<file> → ../../blobs/<etag>,
    refs/<ref> holding the commit hash."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_repo_id_shape() -> None:
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not is_repo_id("gpt2")  # bare names are not taken for Hub ids: a typo'd directory would be
    assert not is_repo_id("/abs/dir") and not is_repo_id("a/b/c") and not is_repo_id("a--b/c")


def test_offline_cache_resolves_and_matches_hf(
    hf_cache: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = lay_out_cache(hf_cache, "tiny-org/tiny-llama", llama_dir, COMMIT)
    assert resolve_model_path("tiny-org/tiny-llama") == str(snapshot)
    llm = LLM("tiny-org/tiny-llama", num_kv_blocks=32)
    assert llm.engine.config.model.path == str(snapshot)
    out = llm.generate(["def fib(n):"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, out.prompt_token_ids, 8)


def test_offline_revision_and_missing_id(hf_cache: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    lay_out_cache(hf_cache, "tiny-org/tiny-llama", llama_dir, COMMIT)
    v1 = lay_out_cache(hf_cache, "tiny-org/tiny-llama", llama_dir, COMMIT_V1, ref="v1")
    assert resolve_model_path("tiny-org/tiny-llama", revision="v1") == str(v1)
    with pytest.raises(ValueError, match=r"'tiny-org/tiny-llama' \(revision 'v2'\) is not in the Hugging Face cache"):
        resolve_model_path("tiny-org/tiny-llama", revision="v2")
    with pytest.raises(ValueError, match=r"'tiny-org/absent' \(revision 'main'\).*HF_HUB_OFFLINE"):
        resolve_model_path("tiny-org/absent")
    # a commit hash names its snapshot directly
    assert resolve_model_path("tiny-org/tiny-llama", revision=COMMIT).endswith(COMMIT)


def test_local_directory_wins(tmp_path: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(llama_dir, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("tiny-org/tiny-llama") == "tiny-org/tiny-llama"
    with pytest.raises(ValueError, match="neither a local path nor a Hugging Face Hub id"):
        resolve_model_path("no/such/dir")


class FakeHub:
    """A loopback HTTP server answering the three requests snapshot_download makes: repo info for a
    revision, the recursive file tree of a commit, and HEAD/GET of /{repo}/resolve/{commit}/{file}."""

    def __init__(self, repo_id: str, files: dict[str, bytes], revisions: dict[str, str]) -> None:
        self.repo_id, self.files, self.revisions = repo_id, files, revisions
        self.downloaded: list[str] = []
        self.auth_headers: set[str | None] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                hub.auth_headers.add(self.headers.get("authorization"))
                path = self.path.split("?")[0]
                info_prefix = f"/api/models/{hub.repo_id}/revision/"
                tree_prefix = f"/api/models/{hub.repo_id}/tree/"
                file_prefix = f"/{hub.repo_id}/resolve/"
                if path.startswith(info_prefix):
                    rev = path[len(info_prefix) :]
                    if rev not in hub.revisions:
                        return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
                    sha = hub.revisions[rev]
                    siblings = [{"rfilename": f} for f in hub.files]
                    return self._json({"id": hub.repo_id, "sha": sha, "siblings": siblings}, body)
                if path.startswith(tree_prefix):
                    entries = [
                        {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in hub.files.items()
                    ]
                    return self._json(entries, body)
                if path.startswith(file_prefix):
                    commit, _, name = path[len(file_prefix) :].partition("/")
                    data = hub.files.get(name)
                    if data is None or commit not in hub.revisions.values():
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
                    if body:
                        hub.downloaded.append(name)
                    etag = f'"{hashlib.sha1(data).hexdigest()}"'
                    return self._send(200, data, {"X-Repo-Commit": commit, "ETag": etag}, body)
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)

            def _json(self, obj: object, body: bool) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body)

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    files = {f.name: f.read_bytes() for f in llama_dir.iterdir()}
    files["pytorch_model.bin"] = b"not needed"  # weights in a format the engine does not read
    files["README.md"] = b"# tiny"
    with FakeHub("tiny-org/tiny-llama", files, {"main": COMMIT, "v1": COMMIT_V1}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        yield hub


def test_download_from_stand_in_hub(hf_cache: Path, fake_hub: FakeHub, llama_dir: Path) -> None:
    path = resolve_model_path("tiny-org/tiny-llama")
    assert Path(path) == hf_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (hf_cache / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == COMMIT
    assert sorted(fake_hub.downloaded) == sorted(f.name for f in llama_dir.iterdir()), "only the needed files"
    assert not (Path(path) / "pytorch_model.bin").exists()
    assert fake_hub.auth_headers == {"Bearer hf_test_token"}, "HF_TOKEN is sent"
    # a revision is resolved to its own commit; a second resolution of main is served from the cache
    assert resolve_model_path("tiny-org/tiny-llama", revision="v1").endswith(COMMIT_V1)
    n = len(fake_hub.downloaded)
    assert resolve_model_path("tiny-org/tiny-llama") == path
    assert len(fake_hub.downloaded) == n, "cached files are not downloaded again"
    with pytest.raises(ValueError, match=r"'tiny-org/tiny-llama' \(revision 'v9'\).*no such revision"):
        resolve_model_path("tiny-org/tiny-llama", revision="v9")
    with pytest.raises(ValueError, match=r"'tiny-org/other' \(revision 'main'\) is not on the Hub"):
        resolve_model_path("tiny-org/other")


def test_cli_positional_hub_id_offline(tmp_path: Path) -> None:
    """`lmserve serve org/name` with HF_HUB_OFFLINE=1 and an empty HF_HOME: exit 2 naming id and revision
    before any port is bound (the environment is read by huggingface_hub at process start)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "lmserve.entrypoints.cli", "serve", "tiny-org/absent", "--revision", "v3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "'tiny-org/absent' (revision 'v3') is not in the Hugging Face cache" in proc.stderr
    assert str(tmp_path / "hf_home" / "hub") in proc.stderr


def test_memory_cli_takes_a_hub_id(
    hf_cache: Path, llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmserve memory --model org/name` reads the shape from the cached config.json, as a directory's."""
    from huggingface_hub import constants

    from lmserve.entrypoints.cli import main

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    lay_out_cache(hf_cache, "tiny-org/tiny-llama", llama_dir, COMMIT)
    assert main(["memory", "--model", str(llama_dir), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert main(["memory", "--model", "tiny-org/tiny-llama", "--json"]) == 0
    hub = json.loads(capsys.readouterr().out)
    assert hub["shape"] == local["shape"] and hub["kv_bytes_per_token"] == local["kv_bytes_per_token"] > 0
    assert main(["memory", "--model", "tiny-org/absent"]) == 2  # not cached, offline: a clear error, exit 2
