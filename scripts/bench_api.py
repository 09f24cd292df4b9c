#!/usr/bin/env python3
"""API benchmarks, in one run on loopback:
  1. counting: the time to answer a submit of 4,096 prompts holding about 2M tokens (the caps),
     which the server tokenizes for real before admitting it;
  2. status polls under load: wrk against GET /v1/harvest/{id} (p50, p99, requests/s);
  3. status polls at a paced 1,000 requests/s (4 keep-alive connections, 250/s each) for
     HARVEST_BENCH_PACED_S seconds (default 30): p50, p99 and p99.9, measured client-side.

    python3 scripts/bench_api.py        (needs wrk for step 2: apt-get install wrk)
    python3 scripts/bench_api.py --soak 600
        the soak instead: the paced 1,000 polls/s for that many seconds while another client
        submits jobs that really run (max_workers 1), cancels, long-polls and downloads; the
        server's resident memory and open file descriptors are sampled every 10 s.

Workers are held back (max_workers 0), so the job stays pending and only the API is measured.
"""
import contextlib
import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))
MODEL = CACHE / "models" / "smollm2-135m"
PORT = int(os.environ.get("HARVEST_BENCH_PORT", "18480"))
WORDS = ("residual stream features attention heads move information between positions while the "
         "mlp writes new directions that probes read").split()


@contextlib.contextmanager
def running_server(max_workers, limits, **extra):
    """Builds the release binaries, starts the embedded server on PORT with one account, and
    yields it with a key; the server is stopped on exit."""
    subprocess.run(["cargo", "build", "--quiet", "--release", "-p", "harvester", "-p", "harvest-api"], cwd=ROOT, check=True)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "config.json").write_text(json.dumps({
            "data_dir": str(tmp / "data"), "harvester": str(target / "harvester"), "max_workers": max_workers,
            "public_url": f"http://127.0.0.1:{PORT}", **extra,
            "models": [{"name": "smollm2-135m", "path": str(MODEL)}],
            "accounts": [{"name": "bench", "limits": limits}]}))
        api = [str(target / "harvest-api"), "--config", str(tmp / "config.json")]
        key = subprocess.run(api + ["create-key", "--account", "bench"], check=True, capture_output=True, text=True).stdout.strip()
        server = subprocess.Popen(api + ["serve", "--listen", f"127.0.0.1:{PORT}"], stderr=subprocess.DEVNULL,
                                  env={**os.environ, "RUST_LOG": "warn"})
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{PORT}/healthz")
                    break
                except OSError:
                    time.sleep(0.1)
            yield server, key
        finally:
            server.terminate()
            server.wait()


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--soak":
        return soak(float(sys.argv[2]))
    with running_server(max_workers=0, limits={"monthly_jobs_per_key": 100000}) as (server, key):
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(462)) for _ in range(4096)]
        body = json.dumps({"model": "smollm2-135m", "prompts": prompts}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/harvest", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req) as r:
                status, job = r.status, json.load(r)
        except urllib.error.HTTPError as e:
            status, job = e.code, json.load(e)
        took = time.perf_counter() - start
        print(f"counting: 4096 prompts, {len(body) / 1e6:.1f} MB body -> HTTP {status} in {took:.2f} s")
        if status != 202:
            print(f"  {job}")
            return 1
        print(f"  reserved_tokens {job['reserved_tokens']} (bytes + 1 per prompt)")
        url = f"http://127.0.0.1:{PORT}/v1/harvest/{job['job_id']}"
        paced_polls(f"/v1/harvest/{job['job_id']}", key)
        if not shutil.which("wrk"):
            print("status polls: wrk is not installed (apt-get install wrk); skipped")
            return 0
        for connections in (8, 32):
            out = subprocess.run(["wrk", "-t2", f"-c{connections}", "-d10s", "--latency", "-H",
                                  f"Authorization: Bearer {key}", url], capture_output=True, text=True).stdout
            rps = re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)
            p50 = re.search(r"50%\s+(\S+)", out).group(1)
            p99 = re.search(r"99%\s+(\S+)", out).group(1)
            print(f"status polls, wrk 2 threads {connections} connections 10 s: {rps} requests/s, p50 {p50}, p99 {p99}")
    return 0


def api_call(method, path, key, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def footprint(pid):
    rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def soak(seconds):
    """Polls paced at 1,000/s for `seconds`, beside mixed traffic with real jobs."""
    import threading
    with running_server(max_workers=1, limits={"monthly_jobs_per_key": 1000000, "daily_tokens": 1000000000},
                        worker_threads=1) as (server, key):
        status, job = api_call("POST", "/v1/harvest", key, {"model": "smollm2-135m", "prompts": ["a poll target"]})
        target_path = f"/v1/harvest/{job['job_id']}"
        stop = threading.Event()
        counts = {"requests": 0, "jobs": 0}
        samples = []

        def mixed():
            rng = random.Random(1)
            last = None
            while not stop.is_set():
                status, job = api_call("POST", "/v1/harvest", key, {"model": "smollm2-135m", "layers": [3],
                    "prompts": [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(4)]})
                counts["requests"] += 1
                if status == 202:
                    counts["jobs"] += 1
                    last = job["job_id"]
                if last:
                    _, seen = api_call("GET", f"/v1/harvest/{last}?wait=1", key)
                    counts["requests"] += 1
                    if rng.random() < 0.2 and seen.get("status") in ("pending", "running"):
                        api_call("DELETE", f"/v1/harvest/{last}", key)
                        counts["requests"] += 1
                    for url in (seen.get("result") or {}).get("shard_urls", [])[:1]:
                        urllib.request.urlopen(url).read()
                        counts["requests"] += 1
                time.sleep(0.2)

        def sample():
            while not stop.wait(10):
                samples.append(footprint(server.pid))

        threads = [threading.Thread(target=mixed), threading.Thread(target=sample)]
        samples.append(footprint(server.pid))
        for t in threads:
            t.start()
        os.environ["HARVEST_BENCH_PACED_S"] = str(seconds)
        paced_polls(target_path, key)
        stop.set()
        for t in threads:
            t.join()
        samples.append(footprint(server.pid))
        print(f"soak: {seconds:.0f} s, mixed traffic {counts['requests']} requests, {counts['jobs']} jobs submitted")
        print(f"  server RSS KiB first {samples[0][0]}, after a quarter {samples[len(samples) // 4][0]}, last {samples[-1][0]}; "
              f"fds first {samples[0][1]}, max {max(s[1] for s in samples)}, last {samples[-1][1]}")
    return 0


def paced_polls(path, key, rate=1000, connections=4):
    """Status polls at a fixed rate, each connection on its own thread and schedule, so a slow
    answer delays the next request of its connection only (no coordinated omission: latency is
    counted from the scheduled send time)."""
    import http.client
    import threading
    seconds = float(os.environ.get("HARVEST_BENCH_PACED_S", "30"))
    per = rate / connections
    latencies, errors = [], []
    lock = threading.Lock()

    def run():
        conn = http.client.HTTPConnection("127.0.0.1", PORT)
        mine, start, sent = [], time.perf_counter(), 0
        while True:
            due = start + sent / per
            if due - start >= seconds:
                break
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                errors.append(response.status)
            mine.append(time.perf_counter() - due)
            sent += 1
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(connections)]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - begun
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
    print(f"status polls paced at {rate}/s over {connections} connections for {seconds:.0f} s: "
          f"{len(latencies) / took:.0f} requests/s done, p50 {pick(0.5):.2f} ms, p99 {pick(0.99):.2f} ms, "
          f"p99.9 {pick(0.999):.2f} ms, {len(errors)} non-200")


if __name__ == "__main__":
    sys.exit(main())
