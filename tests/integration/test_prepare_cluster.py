"""`plm data prepare` on a multi-node Ray cluster (ray.cluster_utils.Cluster on this
machine): the worker nodes write the shards (and drop the duplicates found after the
write from them), and the bytes equal a one-CPU run's."""

import pytest

from pipeline.data.shards import DataDir
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.prepare import run_prepare
from pipeline.prepare.tokenizer import TokenizerSpec, train_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}  # fmt: skip


def test_worker_nodes_write_the_same_bytes_as_one_cpu(tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    import ray
    from conftest import synthetic_corpus
    from ray.cluster_utils import Cluster

    corpus = tmp_path / "corpus.txt"
    docs = synthetic_corpus(n_docs=400).strip().split("\n\n")
    docs += docs[::37] + docs[5:8]  # repeats in later units: fix tasks on the worker nodes
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    tok = train_tokenizer([str(corpus)], TokenizerSpec(kind="wordpiece", vocab_size=300),
                          tmp_path / "tok")  # fmt: skip

    def cfg(out, **kw):
        return PrepareConfig(inputs=[str(corpus)], tokenizer=str(tok), output=str(tmp_path / out),
                             valid_fraction=0.1, shard_docs=50, split_bytes=20_000, **kw)  # fmt: skip

    one = run_prepare(cfg("one", num_cpus=1))  # its own local Ray, one CPU
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # head runs no task
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        many = run_prepare(cfg("many", ray_address=cluster.address))
    finally:
        ray.shutdown()
        cluster.shutdown()
    stats = DataDir(many).manifest["stats"]
    assert stats["units"] >= 4 and stats["units_rewritten_for_duplicates"] >= 1
    assert DataDir(many).manifest["rejected"] == {"duplicate": len(docs) - 400}
    assert stats["writer_nodes"] == 2  # both worker nodes wrote parts, the head none
    assert DataDir(one).manifest["stats"]["writer_nodes"] == 1
    assert files(many) == files(one)
    assert DataDir(many).verify() == []
