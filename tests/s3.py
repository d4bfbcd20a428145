"""A real S3 endpoint for tests: moto's threaded server, as s3fs's own suite uses it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class MotoS3:
    """A moto S3 server on a loopback port that can be stopped and started again on the
    same port (the buckets live in the process, so they survive a restart)."""

    def __init__(self, port: int):
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server = None

    def start(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, **_creds(self.env)).create_bucket(
            Bucket=name
        )


def _creds(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


@contextmanager
def moto_s3(port: int, buckets: tuple[str, ...] = ()) -> Iterator[MotoS3]:
    """Start a moto server, point the AWS variables at it, create ``buckets``; undo after."""
    server = MotoS3(port).start()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    try:
        for b in buckets:
            server.create_bucket(b)
        yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
