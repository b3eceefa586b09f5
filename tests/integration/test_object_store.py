"""Packed datasets in an object store: packed to s3://, read back, trained on, against the same shards on disk.

The bucket lives in moto's standalone S3 server, started by this module on 127.0.0.1 (a thread of
this process); the endpoint and the credentials reach obstore, and the processes the tests start,
through the environment variables a real deployment would use (AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
from helpers import EVAL_TINY, REPO, TINY_TRAIN, _without_timings, assert_ok, clean_env, in_process, read_metrics

from distribuuuu.data import DataError, remote
from distribuuuu.data.packed import BadShardError, PackedDataset

pytest.importorskip("wids")
pytest.importorskip("obstore")
moto_server = pytest.importorskip("moto.server")
DIGITS = REPO / "data" / "digits"
PACK = str(REPO / "tools" / "pack_dataset.py")
BUCKET = "distribuuuu-test"


@pytest.fixture(scope="module")
def s3_env():
    """A local S3 server with an empty bucket; its endpoint and credentials set in os.environ meanwhile."""
    import logging

    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server._server.server_port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    remote._STORES.clear()  # stores built for another endpoint
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=BUCKET)
        yield s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        remote._STORES.clear()
        server.stop()


@pytest.fixture(scope="module")
def packed_both(s3_env, tmp_path_factory):
    """data/digits packed by the tool twice, 300 a shard: into a folder, and into s3://BUCKET/digits."""
    local = tmp_path_factory.mktemp("local") / "digits"
    staging = tmp_path_factory.mktemp("staging")
    for out, extra in ((str(local), []), (f"s3://{BUCKET}/digits", ["--staging", str(staging)])):
        result = in_process(PACK, str(DIGITS), out, "--shard-size", "300", *extra, env=clean_env())
        assert_ok(result)
    assert "train: 5 shards uploaded to s3://distribuuuu-test/digits/train, 0 already there" in result.stdout
    return local, f"s3://{BUCKET}/digits", staging


def _objects(s3, prefix: str) -> dict[str, bytes]:
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    return {o["Key"][len(prefix) :]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing}


def test_packing_to_a_bucket_uploads_the_shards_and_index_the_folder_gets_and_resumes(s3_env, packed_both, tmp_path):
    """Every shard and index in the bucket (read with boto3) is byte for byte the one packed into
    the folder; a second run uploads nothing; a shard lost from the bucket is uploaded again alone."""
    local, url, staging = packed_both
    for split in ("train", "val"):
        objects = _objects(s3_env, f"digits/{split}/")
        files = {p.name: p.read_bytes() for p in (local / split).iterdir() if p.is_file()}
        assert {k: v for k, v in objects.items() if not k.startswith(".parts/")} == files, split
    s3_env.delete_object(Bucket=BUCKET, Key="digits/train/.parts/000003.json")
    again = in_process(PACK, str(DIGITS), url, "--shard-size", "300", "--staging", str(staging), env=clean_env())
    assert_ok(again)
    assert "train: 1436 samples in 5 shards (0 written, 5 kept)" in again.stdout
    assert "train: 1 shards uploaded to s3://distribuuuu-test/digits/train, 4 already there" in again.stdout
    assert "val: 0 shards uploaded" in again.stdout


def test_a_bucket_reads_as_the_same_samples_as_the_folder(packed_both, tmp_path):
    local, url, _ = packed_both
    for split in ("train", "val"):
        from_disk = PackedDataset(str(local), split, "pil", cache_dir=str(tmp_path / "disk"))
        from_s3 = PackedDataset(url, split, "pil", cache_dir=str(tmp_path / "s3"))
        assert from_s3.samples == from_disk.samples and from_s3.classes == from_disk.classes
        for i in range(0, len(from_disk), 37):
            assert from_s3.encoded(i)[0] == from_disk.encoded(i)[0], f"{split} sample {i}"
    cached = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "s3").iterdir() if p.name != ".locks")
    assert cached == sorted([f"shard-00000{i}.tar" for i in range(5)] + ["shard-000000.tar", "shard-000001.tar"])


def test_a_missing_object_or_bucket_is_one_error_naming_it(packed_both, tmp_path):
    _, url, _ = packed_both
    with pytest.raises(
        DataError, match=rf"^cannot read s3://{BUCKET}/nowhere/train/index\.json: no such object \(or bucket\)$"
    ):
        PackedDataset(f"s3://{BUCKET}/nowhere", "train")
    data = b"x" * 10
    with pytest.raises(BadShardError, match=rf"^shard {url}/train/missing\.tar: no such object \(or bucket\)$"):
        remote.download(f"{url}/train/missing.tar", str(tmp_path / "m"), len(data), hashlib.md5(data).hexdigest())
    assert not os.listdir(tmp_path)


def test_without_obstore_a_bucket_url_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore raises ImportError
    monkeypatch.setattr(remote, "_STORES", {})
    with pytest.raises(DataError, match=r"needs obstore: pip install 'distribuuuu\[cloud\]'"):
        PackedDataset("s3://bucket/digits", "train")
    with pytest.raises(DataError, match=r"needs obstore: pip install 'distribuuuu\[cloud\]'"):
        remote.upload(__file__, "gs://bucket/x")


@pytest.mark.slow  # two 1-epoch runs
def test_a_run_trains_from_a_bucket_exactly_as_from_the_same_shards_on_disk(packed_both, tmp_path):
    """One process each (in this one): a bucket is read through the same shard cache as an HTTP
    server, whose sharing by ranks and workers tests/integration/test_shard_cache.py's two-node test shows."""
    local, url, _ = packed_both
    metrics = {}
    for name, root in (("disk", str(local)), ("s3", url)):
        data = ["TRAIN.DATASET", root, "TEST.DATASET", root, "DATA.SHARD_CACHE", str(tmp_path / f"cache_{name}")]
        args = ["OUT_DIR", str(tmp_path / name), *EVAL_TINY, "OPTIM.MAX_EPOCH", "1", *data]
        assert_ok(in_process(TINY_TRAIN, *args, env=clean_env()))  # clean_env keeps AWS_ENDPOINT_URL and the keys
        metrics[name] = [_without_timings(r) for r in read_metrics(tmp_path / name)]
    assert metrics["s3"] == metrics["disk"] and len(metrics["disk"]) == 2
    assert {"val", "train"} == {r["split"] for r in metrics["disk"]}
    cached = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache_s3").iterdir() if p.name != ".locks")
    assert cached == sorted([f"shard-00000{i}.tar" for i in range(5)] + ["shard-000000.tar", "shard-000001.tar"])
