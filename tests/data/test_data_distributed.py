"""Two real gloo workers build data=files: rank 0 preprocesses, rank 1 waits and loads the same entry."""
import json

import pytest
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from tests.helpers.data import TRAIN_EN, small_files_cfg


def _worker(rank: int, world_size: int, port: int, cfg: dict, out: str) -> None:
    from tests.helpers.dist import join_gloo
    from transformer import dist
    from transformer.data.translation import build_translation_data
    env = join_gloo(rank, world_size, port)
    try:
        dm = build_translation_data(OmegaConf.create(cfg), env, f"{out}/run" if rank == 0 else None)
        ids = [i for batch in dm.train_loader(0) for i in batch.ids.tolist()]
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"ids": ids, "state": dm.tokenizer.state_dict(), "batches": dm.num_train_batches(0)}, f)
    finally:
        dist.close()


@pytest.mark.distributed
def test_two_ranks_share_one_preprocessing(tmp_path):
    from tests.helpers.cli import free_port
    cfg = small_files_cfg(tmp_path, max_tokens=30)
    mp.spawn(_worker, args=(2, free_port(), OmegaConf.to_container(cfg), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["state"] == r1["state"]
    assert r0["batches"] == r1["batches"] > 0
    assert sorted(r0["ids"] + r1["ids"]) == list(range(len(TRAIN_EN)))
    from transformer.data.cache import cache_folder
    assert len(list(cache_folder(cfg.data.cache_dir, tmp_path / "root").iterdir())) == 1
    assert (tmp_path / "run" / "tokenizer.json").exists()
