"""Checkpoints and output on S3: a running word count whose state and files live under s3://.

Run it against your bucket (credentials from the usual AWS chain; AWS_ENDPOINT_URL for
MinIO or another S3-compatible server):

    python examples/s3_checkpoints.py s3://my-bucket/epochstream-demo

Without an argument it starts moto's S3 server on localhost (installed with the dev extra)
and uses a bucket there, so the example runs anywhere.
"""

import os
import sys

from epochstream import FileSink, Pipeline
from epochstream.backends import open_storage

WORDS = "the quick brown fox jumps over the lazy dog and the dog sleeps".split()


def build(base: str) -> Pipeline:
    p = Pipeline("s3-wordcount", parallelism=2, checkpoint_interval=0.2)
    (p.generate(lambda i: (WORDS[i % len(WORDS)], 1), count=60_000, uid="words")
      .key_by(lambda pair: pair[0])
      .reduce(lambda a, b: (a[0], a[1] + b[1]), uid="count")   # running count per word
      .sink(FileSink(f"{base}/out"), uid="counts"))
    return p


def main() -> None:
    server = None
    if len(sys.argv) > 1:
        base = sys.argv[1].rstrip("/")
    else:
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=5055, verbose=False)
        server.start()
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        os.environ["AWS_ENDPOINT_URL"] = "http://127.0.0.1:5055"
        boto3.client("s3").create_bucket(Bucket="demo")
        base = "s3://demo/wordcount"
    try:
        result = build(base).run(deployment="local", checkpoint_dir=f"{base}/chk", restore="latest")
        print(f"{len(result.completed_epochs)} epochs committed, latest checkpoint {result.latest_checkpoint}")
        for epoch in open_storage(f"{base}/chk").list_checkpoints():
            print("  checkpoint", epoch)
        files = FileSink(f"{base}/out").committed_files()
        print(f"{len(files)} committed output files under {base}/out, e.g. {files[0] if files else '-'}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
