#!/usr/bin/env python3
"""The seed's client flow against a harvest server, with the standard library only:
submit the two example prompts, wait with ?wait=, download the first shard through its signed
link (no key) and print its tensors' shapes.

    ACS_API_BASE=http://127.0.0.1:8080/v1 ACS_API_KEY=sk-... python3 scripts/demo_client.py
"""
import json
import os
import struct
import urllib.request

API_BASE = os.environ["ACS_API_BASE"]
KEY = os.environ["ACS_API_KEY"]


def call(method, url, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as response:
        return response.status, json.load(response)


status, job = call("POST", f"{API_BASE}/harvest", {
    "model": "smollm2-135m",
    "prompts": ["The quick brown fox jumps over the lazy dog.",
                "Interpretability research reads the residual stream."],
    "layers": [8, 16, 24],
})
print(f"submitted: {status} {job['job_id']} status={job['status']} reserved_tokens={job['reserved_tokens']}")
while job["status"] in ("pending", "running"):
    _, job = call("GET", f"{API_BASE}/harvest/{job['job_id']}?wait=30")
print(f"finished: status={job['status']} tokens={job['tokens']}")
if job["status"] != "done":
    raise SystemExit(f"job did not finish: {job.get('error')}")
shard = urllib.request.urlopen(job["result"]["shard_urls"][0]).read()
(header_len,) = struct.unpack("<Q", shard[:8])
header = json.loads(shard[8:8 + header_len])
print(f"shard_00000.safetensors: {len(shard)} bytes, downloaded without a key")
for name in sorted(k for k in header if k != "__metadata__"):
    print(f"  {name:<10} {header[name]['dtype']:<5} {header[name]['shape']}")
