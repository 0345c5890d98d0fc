"""A real S3 API server on 127.0.0.1 for tests and benches: moto's standalone server (the dev extra) in its own
process, one bucket, the AWS_* variables set for this process while it runs (pyarrow's S3 filesystem takes its
endpoint from AWS_ENDPOINT_URL, as a user of an S3-compatible store sets it)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket: str, versioned: bool = False):
    """Yields the endpoint URL. `versioned`: the bucket keeps every version of every object, so the bytes
    PUT into it can be counted afterwards (object_versions)."""
    import pyarrow.fs

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    try:
        deadline = time.time() + 30
        while True:
            try:
                pyarrow.fs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True).create_dir(bucket)
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        if versioned:
            _client(endpoint).put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        yield endpoint
    finally:
        server.kill()
        server.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ENV["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=ENV["AWS_SECRET_ACCESS_KEY"], region_name=ENV["AWS_DEFAULT_REGION"])


def object_versions(endpoint: str, bucket: str, prefix: str) -> list[dict]:
    """Every version of every object under `prefix` in a versioned bucket: what was PUT there (Key, Size)."""
    pages = _client(endpoint).get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix)
    return [v for page in pages for v in page.get("Versions", [])]
