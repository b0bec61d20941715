"""engine.target_revision / drafter_revision: every load of a hub repo id asks for the pinned
commit (the hub's functions are stood in for, offline), GetModelInfo and the startup log show it,
and a revision for a local folder is refused."""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import transformers

import dflash_serve.services.engine.loader as loader
import dflash_serve.services.models.target as target_module
import dflash_serve.services.models.target_files as target_files
from dflash_serve.services.api.dflash.v1 import generation_pb2
from dflash_serve.services.config import EngineConfig, ServeConfig
from dflash_serve.services.models import CheckpointError, TargetLoadError
from tests.served_pair import VOCAB, save_tiny_pair
from tests.tokenizer import train_tiny_tokenizer

TARGET, DRAFTER = "org/target", "org/drafter"
ENGINE = {"target": TARGET, "drafter": DRAFTER, "target_revision": "t-commit", "drafter_revision": "v2",
          "max_num_seqs": 2}


class FakeHub:
    """Stands in for the hub: records (what was loaded, repo id, revision) of every load of a
    repo id, and serves the repo ids from local folders."""

    def __init__(self, folders: dict[str, str]):
        self.folders = folders
        self.calls: list[tuple[str, str, str | None]] = []

    def patch(self, monkeypatch, kind: str, cls) -> None:
        """cls.from_pretrained (transformers' Auto classes) records the call and loads the folder."""
        real = cls.from_pretrained

        def from_pretrained(name, *args, revision=None, **kwargs):
            if name not in self.folders:  # a folder: what the loader itself reads inside
                return real(name, *args, revision=revision, **kwargs)
            self.calls.append((kind, name, revision))
            return real(self.folders[name], *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)

    def snapshot_download(self, name, *, revision=None, allow_patterns=None):
        self.calls.append(("snapshot", name, revision))
        return self.folders[name]

    def patch_tokenizer_classes(self, monkeypatch) -> None:
        """Every tokenizer class's from_pretrained (a class AutoTokenizer chose before, loaded
        directly: `target_files.load_tokenizer`), as `patch` does."""
        real = transformers.PreTrainedTokenizerBase.from_pretrained.__func__

        def from_pretrained(cls, name, *args, revision=None, **kwargs):
            if name not in self.folders:
                return real(cls, name, *args, revision=revision, **kwargs)
            self.calls.append(("tokenizer", name, revision))
            return real(cls, self.folders[name], *args, **kwargs)

        monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "from_pretrained", classmethod(from_pretrained))

    def patch_files(self, monkeypatch, module) -> None:
        """module.cached_file (a single file of a repo: the router's reads) records the call and
        reads the folder."""
        real = module.cached_file

        def cached_file(name, filename, *, revision=None, **kwargs):
            if name in self.folders:
                self.calls.append(("file", name, revision))
                name = self.folders[name]
            return real(name, filename, **kwargs)

        monkeypatch.setattr(module, "cached_file", cached_file)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> FakeHub:
    target, drafter = save_tiny_pair(tmp_path, block_size=4)
    fake = FakeHub({TARGET: target, DRAFTER: drafter})
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))  # no tokenizer class kept by another test
    fake.patch_files(monkeypatch, target_files)
    fake.patch_tokenizer_classes(monkeypatch)
    for kind, cls in (("model", transformers.AutoModelForCausalLM), ("config", transformers.AutoConfig),
                      ("tokenizer", transformers.AutoTokenizer), ("generation_config", transformers.GenerationConfig)):
        fake.patch(monkeypatch, kind, cls)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    return fake


def test_the_engine_loads_every_file_at_its_revision_and_logs_them(hub, caplog):
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        engine = loader.build_engine(EngineConfig(**ENGINE))
    assert engine.tokenizer is not None and engine.eos_token_ids
    # The target's config is read first (a multimodal checkpoint loads its text model alone).
    assert sorted(set(hub.calls)) == [("config", TARGET, "t-commit"), ("file", TARGET, "t-commit"),
                                      ("generation_config", TARGET, "t-commit"), ("model", TARGET, "t-commit"),
                                      ("snapshot", DRAFTER, "v2"), ("tokenizer", TARGET, "t-commit")]
    assert "models: target org/target at revision t-commit; drafter org/drafter at revision v2" in caplog.text


def test_unpinned_models_load_the_default_branch_and_the_log_says_so(hub, caplog):
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        loader.build_engine(EngineConfig(target=TARGET, drafter=DRAFTER, max_num_seqs=2))
    assert {revision for _, _, revision in hub.calls} == {None}
    assert "target org/target (unpinned: a local folder or the default branch)" in caplog.text


def test_the_drafter_actor_and_server_load_the_drafter_revision(hub):
    from dflash_serve.services.drafter.actor import DrafterActor

    actor = DrafterActor(DRAFTER, "cpu", "float32", "v2")
    actor.server.listener.close()
    assert hub.calls == [("snapshot", DRAFTER, "v2")]
    assert gc.get_freeze_count() > 0  # a serving process: its start-up objects frozen


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> None:
    """The repo ids at their revisions in an offline Hugging Face cache, for the processes this
    test starts (the verifier's engine process), which FakeHub's patches do not reach."""
    folders = dict(zip((TARGET, DRAFTER), save_tiny_pair(tmp_path / "folders", block_size=4), strict=True))
    cache = tmp_path / "hub"
    for (name, revision), commit in zip(((TARGET, "t-commit"), (DRAFTER, "v2")), ("1" * 40, "2" * 40), strict=True):
        repo = cache / f"models--{name.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / revision).write_text(commit)
        shutil.copytree(folders[name], repo / "snapshots" / commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_get_model_info_shows_the_revisions(hub_cache):
    """The verifier's model_info, through the router's GetModelInfo, as a client reads it."""
    from transformers import PreTrainedTokenizerFast

    from dflash_serve.services.router.router import Router
    from dflash_serve.services.verifier.verifier import Verifier

    verifier = Verifier({"engine": ENGINE, "topology": "colocated"})
    try:
        info = verifier.model_info()
        assert (info["target_revision"], info["drafter_revision"]) == ("t-commit", "v2")

        async def model_info():
            return verifier.model_info()

        handle = SimpleNamespace(model_info=SimpleNamespace(remote=model_info))
        router = Router(handle, PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(VOCAB)), max_model_len=256, max_tokens_limit=64,
                        default_max_tokens=16, max_pending=4)
        reply = asyncio.run(router.GetModelInfo(generation_pb2.GetModelInfoRequest(), None))
        assert (reply.target, reply.target_revision, reply.drafter, reply.drafter_revision) == (
            TARGET, "t-commit", DRAFTER, "v2")
    finally:
        verifier.shutdown()


def test_unpinned_model_info_has_empty_revisions(tmp_path):
    from dflash_serve.services.verifier.verifier import Verifier

    target, drafter = save_tiny_pair(tmp_path, block_size=4)
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 2}, "topology": "colocated"})
    try:
        info = verifier.model_info()
        assert (info["target_revision"], info["drafter_revision"]) == ("", "")
    finally:
        verifier.shutdown()


def test_the_router_deployment_reads_tokenizer_and_config_at_the_target_revision(hub):
    from dflash_serve.services.app import RouterDeployment

    RouterDeployment(None, ServeConfig(engine=EngineConfig(**ENGINE), ingress="serve").to_dict())
    assert sorted(set(hub.calls)) == [("file", TARGET, "t-commit"), ("tokenizer", TARGET, "t-commit")]
    hub.calls.clear()
    RouterDeployment(None, ServeConfig(engine=EngineConfig(**ENGINE), ingress="serve").to_dict())
    assert sorted(set(hub.calls)) == [("file", TARGET, "t-commit"), ("tokenizer", TARGET, "t-commit")]
    assert gc.get_freeze_count() > 0


def test_training_reads_the_target_config_at_its_revision(hub):
    from dflash_serve.services.training.trainer import TrainConfig, new_drafter_config

    config = TrainConfig(target=TARGET, output="unused", target_revision="t-commit", num_layers=1,
                         mask_token_id=0)
    assert new_drafter_config(config, None).num_hidden_layers == 1
    assert hub.calls == [("config", TARGET, "t-commit")]


def test_a_revision_for_a_local_folder_is_refused_naming_what_to_change(tmp_path):
    """A folder holds whatever was copied into it; loading it while the config claims a pinned
    commit would hide exactly the drift the pin exists to prevent."""
    target, drafter = save_tiny_pair(tmp_path, block_size=4)
    with pytest.raises(TargetLoadError, match=r"target revision 'abc' was given, but the target '.*' is a local "
                                              r"folder, which has no revisions: remove the target revision"):
        loader.build_engine(EngineConfig(target=target, target_revision="abc"))
    with pytest.raises(CheckpointError, match="drafter revision 'v2' was given, but the drafter .* is a local folder"):
        loader.build_engine(EngineConfig(target=target, drafter=drafter, drafter_revision="v2"))
    with pytest.raises(TargetLoadError, match="local folder"):
        target_module.load_target_config(target, "abc")


@pytest.mark.parametrize(("engine", "says"), [
    ({"target_revision": 1234567}, "engine.target_revision=1234567: must be a valid string"),
    ({"target_revision": ""}, "engine.target_revision='': must be a hub commit sha, tag or branch name"),
    ({"drafter": DRAFTER, "drafter_revision": "v2 "}, "engine.drafter_revision='v2 ': must be a hub commit sha"),
    ({"drafter_revision": "v2"}, "drafter_revision='v2' is set without a drafter"),
])
def test_bad_revisions_are_refused_by_the_config(engine, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        ServeConfig.from_dict({"topology": "colocated", "engine": {"target": TARGET, **engine}})


def test_revisions_round_trip_through_the_config():
    config = ServeConfig.from_dict({"engine": ENGINE})
    assert (config.engine.target_revision, config.engine.drafter_revision) == ("t-commit", "v2")
    assert ServeConfig.from_dict(config.to_dict()) == config


def test_the_drafter_loads_on_the_device_asked_with_its_revision(hub):
    from dflash_serve.services.models import load_drafter

    drafter = load_drafter(DRAFTER, dtype=torch.float32, revision="v2")
    assert drafter.dtype == torch.float32 and hub.calls == [("snapshot", DRAFTER, "v2")]
