"""drafter_placement (shared | own_gpu): the placement group a split verifier replica asks for, the
drafter actor's GPU and CUDA visibility, the refusal of a drafter on another node, and the
verifier's KV sizing. The cross-GPU data path itself runs in tests/gpu/test_own_gpu_drafter.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import ray
import torch

from dflash_serve.services.app import VERIFIER_CPUS, build_app
from dflash_serve.services.config import EngineConfig, ServeConfig
from dflash_serve.services.drafter.actor import RAY_NOSET_CUDA_VISIBLE_DEVICES, DrafterActor, cuda_visibility
from dflash_serve.services.engine import loader
from dflash_serve.services.models import TargetModel
from dflash_serve.services.verifier.verifier import DRAFTER_CPUS, check_same_node, spawn_drafter_actor
from tests.conftest import drafter_config, random_drafter
from tests.targets import tiny_target

CUDA_PAIR = {"engine": {"target": "t", "drafter": "d", "device": "cuda"}}


@pytest.mark.parametrize(("raw", "says"), [
    ({**CUDA_PAIR, "drafter_placement": "own_gpu", "topology": "colocated"},
     "drafter_placement=own_gpu needs topology=split (not colocated"),
    ({"engine": {"target": "t", "device": "cuda"}, "topology": "colocated", "drafter_placement": "own_gpu"},
     "needs topology=split (not colocated: a colocated engine has no drafter actor to place) and engine.drafter"),
    ({"engine": {"target": "t", "drafter": "d"}, "drafter_placement": "own_gpu"},
     "drafter_placement=own_gpu needs engine.device=cuda (not cpu); or use drafter_placement=shared"),
    ({**CUDA_PAIR, "drafter_placement": "own"}, "drafter_placement='own': choose one of shared, own_gpu"),
    ({"engine": {**CUDA_PAIR["engine"], "tensor_parallel_size": 2}, "verifier_num_gpus": 0.5},
     "engine.tensor_parallel_size=2 runs each rank on a whole GPU of its own: set verifier_num_gpus to 1"),
])
def test_own_gpu_without_what_it_needs_is_refused_naming_the_fix(raw, says):
    with pytest.raises(ValueError) as raised:
        ServeConfig.from_dict(raw)
    assert says in str(raised.value)


def _bundles(config: ServeConfig) -> tuple[list[dict], str]:
    verifier = build_app(config)._bound_deployment.init_args[0]._bound_deployment  # Ray 2.60's Application
    return verifier._replica_config.placement_group_bundles, verifier._replica_config.placement_group_strategy


@pytest.mark.parametrize(("placement", "verifier_gpus", "bundles", "ranks"), [
    ("shared", 1.0, [{"CPU": VERIFIER_CPUS, "GPU": 1.0}, {"CPU": DRAFTER_CPUS}], 1),
    ("own_gpu", 1.0, [{"CPU": VERIFIER_CPUS, "GPU": 1.0}, {"CPU": DRAFTER_CPUS, "GPU": 1.0}], 1),
    ("own_gpu", 0.5, [{"CPU": VERIFIER_CPUS, "GPU": 0.5}, {"CPU": DRAFTER_CPUS, "GPU": 1.0}], 1),
    # engine.tensor_parallel_size 2: the verifier's bundle holds both ranks' GPUs (one node; its
    # processes see both), the drafter reads rank 0's features on the first.
    ("shared", 1.0, [{"CPU": VERIFIER_CPUS, "GPU": 2.0}, {"CPU": DRAFTER_CPUS}], 2),
    ("own_gpu", 1.0, [{"CPU": VERIFIER_CPUS, "GPU": 2.0}, {"CPU": DRAFTER_CPUS, "GPU": 1.0}], 2),
])
def test_the_drafter_bundle_holds_a_gpu_only_with_own_gpu_and_the_pair_stays_on_one_node(placement, verifier_gpus,
                                                                                        bundles, ranks):
    engine = {**CUDA_PAIR["engine"], "tensor_parallel_size": ranks}
    config = ServeConfig.from_dict({"engine": engine, "drafter_placement": placement,
                                    "verifier_num_gpus": verifier_gpus})
    assert _bundles(config) == (bundles, "STRICT_PACK")
    assert config.gpus_per_drafter == (1.0 if placement == "own_gpu" else 0.0)


def test_a_colocated_tensor_parallel_replica_asks_for_all_its_ranks_gpus():
    """One actor's GPUs are on one node; the replica's engine process starts a rank on each."""
    config = ServeConfig.from_dict({"engine": {"target": "t", "device": "cuda", "tensor_parallel_size": 4},
                                    "topology": "colocated"})
    verifier = build_app(config)._bound_deployment.init_args[0]._bound_deployment
    assert verifier.ray_actor_options["num_gpus"] == 4.0
    assert verifier._replica_config.placement_group_bundles is None


def test_on_cpu_neither_bundle_holds_a_gpu():
    assert _bundles(ServeConfig.from_dict({"engine": {"target": "t", "drafter": "d"}})) == (
        [{"CPU": VERIFIER_CPUS}, {"CPU": DRAFTER_CPUS}], "STRICT_PACK")


@pytest.mark.parametrize(("verifier_ids", "own_ids", "verifier_device", "visible", "device"), [
    (["3"], [], "cuda", "3", "cuda"),  # shared: the verifier's GPU alone, computing where it does
    (["6", "2"], [], "cuda:1", "6,2", "cuda:1"),
    (["3"], ["5"], "cuda", "3,5", "cuda:1"),  # own_gpu: the verifier's cuda:0 is cuda:0 here too
    (["6", "2"], ["0"], "cuda:1", "6,2,0", "cuda:2"),  # a verifier of two GPUs keeps its order
    ([1], [0], "cuda", "1,0", "cuda:1"),  # ray.get_gpu_ids() may give ints
])
def test_the_drafter_sees_the_verifiers_gpus_first_and_computes_on_its_own(verifier_ids, own_ids, verifier_device,
                                                                           visible, device):
    assert cuda_visibility(verifier_ids, own_ids, verifier_device) == (visible, device)


def test_a_drafter_on_cuda_needs_a_verifier_gpu():
    with pytest.raises(ValueError, match="verifier_num_gpus > 0"):
        cuda_visibility([], ["1"], "cuda")


def test_the_actor_sets_its_visibility_before_cuda_starts(monkeypatch):
    """As in the actor's process: Ray gave the verifier GPU 4 and this actor GPU 7."""
    loaded = {}
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [7])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("dflash_serve.services.drafter.server.DrafterServer.load",
                        lambda path, *, device, dtype, revision: loaded.update(device=device) or SimpleNamespace(
                            start=lambda: None))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test
    DrafterActor("d", "cuda", "float32", verifier_gpu_ids=["4"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,7" and loaded["device"] == "cuda:1"


class _FakeRemote:
    """Records what spawn_drafter_actor asks Ray for."""

    def __init__(self):
        self.asked, self.args, self.kwargs = {}, (), {}

    def __call__(self, cls):
        assert cls is DrafterActor
        return self

    def options(self, **options):
        self.asked = options
        return self

    def remote(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return "actor"


@pytest.mark.parametrize("placement", ["shared", "own_gpu"])
def test_the_spawned_drafter_gets_its_gpu_the_verifiers_ids_and_sets_its_own_visibility(placement, monkeypatch):
    fake = _FakeRemote()
    monkeypatch.setattr(ray, "remote", fake)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [2])
    monkeypatch.setattr("ray.util.get_current_placement_group", lambda: None)
    config = ServeConfig.from_dict({**CUDA_PAIR, "drafter_placement": placement})
    actor, name = spawn_drafter_actor(config)
    assert actor == "actor" and fake.asked["name"] == name
    assert fake.asked["num_gpus"] == (1.0 if placement == "own_gpu" else 0.0)
    # Ray must leave CUDA_VISIBLE_DEVICES alone even for an actor it gives a GPU: the actor sets it.
    assert fake.asked["runtime_env"] == {"env_vars": {RAY_NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    assert fake.args == ("d", "cuda", "auto", None) and fake.kwargs == {"verifier_gpu_ids": ["2"]}


def test_a_drafter_on_cpu_takes_no_gpu_and_keeps_its_visibility(monkeypatch):
    fake = _FakeRemote()
    monkeypatch.setattr(ray, "remote", fake)
    monkeypatch.setattr("ray.util.get_current_placement_group", lambda: None)
    spawn_drafter_actor(ServeConfig.from_dict({"engine": {"target": "t", "drafter": "d"}}))
    assert "num_gpus" not in fake.asked and "runtime_env" not in fake.asked
    assert fake.kwargs == {"verifier_gpu_ids": None}


@pytest.mark.parametrize("drafter_node", ["node-a", "node-b"])
def test_a_drafter_on_another_node_is_refused(drafter_node, monkeypatch):
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    monkeypatch.setattr(ray, "get", lambda ref, timeout: ref)
    actor = SimpleNamespace(node_id=SimpleNamespace(remote=lambda: drafter_node))
    if drafter_node == "node-a":
        check_same_node(actor)
        return
    with pytest.raises(RuntimeError, match="runs on node node-b and its verifier on node node-a: a verifier and "
                                           "its drafter must share a node"):
        check_same_node(actor)


@pytest.mark.parametrize("kv_here", [True, False])
def test_the_verifier_counts_the_drafters_kv_only_when_it_shares_the_gpu(kv_here, monkeypatch):
    sized = []
    monkeypatch.setattr(loader, "num_kv_blocks", lambda config, device, per_block, **_: sized.append(per_block) or 64)
    draft_cfg = random_drafter(drafter_config(block_size=4, vocab_size=96, num_target_layers=4, num_hidden_layers=2,
                                              layer_types=["full_attention"] * 2,
                                              dflash_config={"mask_token_id": 95, "target_layer_ids": [1, 3]}),
                               seed=1, dtype=torch.float32).config
    target = TargetModel(tiny_target("llama", layers=4, vocab=96, seed=1).float(), (1, 3))
    config = EngineConfig(target="tiny", kv_block_size=16, max_num_seqs=2, speculation="fixed")
    loader.assemble_engine(config, target, None, remote_drafter=draft_cfg, remote_drafter_kv_here=kv_here)
    d_layers, d_heads, d_dim = loader.DraftRunner.kv_shape(draft_cfg)
    target_block = loader.KVPool.layout_bytes_per_block(loader.TargetRunner.kv_layout(target), 16, torch.float32)
    draft_block = loader.KVPool.bytes_per_block(d_layers, 16, d_heads, d_dim, torch.float32)
    assert sized == [target_block + draft_block if kv_here else target_block]



def test_on_a_gpu_the_kv_cache_holds_what_the_batch_can_use_within_its_share_of_memory(monkeypatch):
    """Not 85 % of the GPU whatever the model: max_num_seqs sequences of max_model_len tokens,
    unless the memory share is smaller; num_kv_blocks set wins."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**20, 140 * 2**30))
    cuda, per_block = torch.device("cuda"), 2**20
    config = EngineConfig(target="tiny", kv_memory_fraction=0.5)
    assert loader.num_kv_blocks(config, cuda, per_block, usable=30) == 30
    assert loader.num_kv_blocks(config, cuda, per_block, usable=3000) == 50  # half of 100 MiB free
    assert loader.num_kv_blocks(EngineConfig(target="tiny", num_kv_blocks=7), cuda, per_block, usable=30) == 7
    # Window slots held apart from the blocks come out of the same share.
    assert loader.num_kv_blocks(config, cuda, per_block, usable=3000, reserved=20 * 2**20) == 30


@pytest.mark.parametrize(("raw", "machine_gpus", "lent"), [
    ({"engine": {"target": "t", "drafter": "d"}}, 0, 0),
    (CUDA_PAIR, 1, 1),
    ({**CUDA_PAIR, "drafter_placement": "own_gpu"}, 2, 2),
    ({**CUDA_PAIR, "drafter_placement": "own_gpu", "verifier_num_gpus": 0.5}, 4, 2),
    ({**CUDA_PAIR, "drafter_placement": "own_gpu"}, 1,
     "a verifier replica takes 2 GPUs (verifier_num_gpus=1.0 plus 1 for its drafter (drafter_placement=own_gpu)), "
     "but this machine has 1"),
    ({"engine": {**CUDA_PAIR["engine"], "tensor_parallel_size": 2}}, 2, 2),
    ({"engine": {**CUDA_PAIR["engine"], "tensor_parallel_size": 2}, "drafter_placement": "own_gpu"}, 2,
     "a verifier replica takes 3 GPUs (verifier_num_gpus=1.0 for each of engine.tensor_parallel_size=2 ranks plus 1 "
     "for its drafter (drafter_placement=own_gpu)), but this machine has 2"),
])
def test_dflash_serve_lends_ray_one_replicas_gpus_with_its_drafters(raw, machine_gpus, lent, monkeypatch):
    from dflash_serve.services.cli import serve

    monkeypatch.setattr(serve, "cuda_device_count", lambda: machine_gpus)
    _local_gpus = serve._local_gpus
    config = ServeConfig.from_dict(raw)
    if isinstance(lent, str):
        with pytest.raises(ValueError, match=re.escape(lent)):
            _local_gpus(config)
    else:
        assert _local_gpus(config) == lent


def test_spawning_a_drafter_actor_imports_no_torch_in_the_verifier_replica():
    """The replica imports the actor's module to spawn it; torch and the drafter's code load in the
    actor's process only (in the replica they took 3.8 s before its engine process started, on a
    restart's critical path)."""
    check = ("import sys\n"
             "from dflash_serve.services.drafter.actor import DrafterActor\n"
             "from dflash_serve.services.verifier.verifier import spawn_drafter_actor\n"
             "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    child = subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]


def test_the_drafter_actors_process_loads_the_drafter_without_transformers():
    """The drafter's forward is ours: its process need not import transformers' model code, which
    took seconds of the drafter actor's start, on a split replica's path to ready (BENCHMARKS, Restarts)."""
    check = ("import sys, torch\n"
             "from dflash_serve.services.drafter.server import DrafterServer\n"
             "from dflash_serve.services.models.default_pair import DEFAULT_DRAFTER_DIR\n"
             "DrafterServer.load(str(DEFAULT_DRAFTER_DIR), device='cpu', dtype=torch.float32)\n"
             "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)[:5]")
    child = subprocess.run([sys.executable, "-c", check], capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
