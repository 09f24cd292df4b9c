#!/usr/bin/env python3
"""API benchmarks, in one run on loopback. Every latency line is of successful answers only: the
per-key rate limit is off where latency is measured (the embedded server's configuration says
`"rate_limit": null`; on Kubernetes the API's ConfigMap says so and its Pods are replaced), and
any answer other than 200 in a latency line fails the run instead of printing a figure.
  1. counting: the time to answer a submit of 4,096 prompts holding about 2M tokens (the caps),
     which the server tokenizes for real before admitting it;
  2. status polls at a paced 1,000 requests/s (4 keep-alive connections, 250/s each) for
     HARVEST_BENCH_PACED_S seconds (default 30): p50, p99 and p99.9, measured client-side;
  3. status polls under load: wrk against GET /v1/harvest/{id} (p50, p99, requests/s);
  4. the rate limiter apart, at its default (50 a second, bursts of 100, per key): one key polled
     at 1,000/s for 5 s, the answers and the refusals (429) per second and the refusals' latency.

    python3 scripts/bench_api.py        (needs wrk for step 3: apt-get install wrk)
    python3 scripts/bench_api.py --kubernetes [fast|real]
        steps 2 and 3 against the Kubernetes backend, through the harvest-api Service of the
        test cluster (scripts/cluster.sh up [--real], release binaries), its watch caches warmed
        by a few hundred polls first; the cluster is taken down afterwards.
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


class Failed(Exception):
    """A latency line met an answer other than 200: no figure is printed for it."""


def machine():
    """The CPU this ran on: its model, cores and vector flags (every benchmark prints them)."""
    info = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    model = next((l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name")), "unknown")
    flags = next((l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags")), [])
    vector = sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx")))
    return f"{model}, {os.cpu_count()} cores, {' '.join(vector) or 'no AVX2'}"


def main():
    print(f"machine: {machine()}")
    try:
        if len(sys.argv) == 3 and sys.argv[1] == "--soak":
            return soak(float(sys.argv[2]))
        if len(sys.argv) >= 2 and sys.argv[1] == "--kubernetes":
            return kubernetes(sys.argv[2] if len(sys.argv) > 2 else "fast")
        return embedded()
    except Failed as failure:
        print(f"FAILED: {failure}")
        return 1


def embedded():
    with running_server(max_workers=0, limits={"monthly_jobs_per_key": 100000}, rate_limit=None) as (server, key):
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
            raise Failed(f"the submit was answered {status}: {job}")
        print(f"  reserved_tokens {job['reserved_tokens']} (bytes + 1 per prompt)")
        path = f"/v1/harvest/{job['job_id']}"
        paced_polls("127.0.0.1", PORT, path, [key])
        wrk_polls(f"http://127.0.0.1:{PORT}{path}", key)
    with running_server(max_workers=0, limits={"monthly_jobs_per_key": 100000}) as (server, key):
        _, job = api_call("POST", "/v1/harvest", key, {"model": "smollm2-135m", "prompts": ["a poll target"]})
        limiter(f"/v1/harvest/{job['job_id']}", key)
    return 0


def wrk_polls(url, key):
    """wrk's status polls at 8 and 32 connections; a non-2xx answer fails the run."""
    if not shutil.which("wrk"):
        print("status polls: wrk is not installed (apt-get install wrk); skipped")
        return
    for connections in (8, 32):
        out = subprocess.run(["wrk", "-t2", f"-c{connections}", "-d10s", "--latency", "-H",
                              f"Authorization: Bearer {key}", url], capture_output=True, text=True).stdout
        refused = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
        if refused:
            raise Failed(f"wrk at {connections} connections met {refused.group(1)} answers other than 2xx or 3xx: {url}")
        rps = re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)
        # The latency distribution's own lines (a thread's "+/- Stdev" may also end in 50%).
        p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1)
        p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1)
        print(f"status polls, wrk 2 threads {connections} connections 10 s: {rps} requests/s, p50 {p50}, p99 {p99}")


def limiter(path, key, rate=1000, seconds=5.0):
    """The rate limiter on its own: one key polled at `rate` a second."""
    answered, refusal_times = 0, []
    start = time.perf_counter()
    for status, took in paced("127.0.0.1", PORT, path, key, rate, seconds):
        if status == 200:
            answered += 1
        elif status == 429:
            refusal_times.append(took)
        else:
            raise Failed(f"the limiter's step was answered {status}")
    took = time.perf_counter() - start
    refusal_times.sort()
    pick = lambda q: refusal_times[min(len(refusal_times) - 1, int(q * len(refusal_times)))] * 1000 if refusal_times else 0.0
    print(f"rate limiter (the default: 50/s a key, bursts of 100): one key polled at {rate}/s for {seconds:.0f} s: "
          f"{answered / took:.0f} answered/s, {len(refusal_times) / took:.0f} refused (429)/s; the refusals' p50 "
          f"{pick(0.5):.2f} ms, p99 {pick(0.99):.2f} ms")


def kubernetes(tier):
    """Paced and wrk polls through the test cluster's harvest-api Service, with the rate limit
    off (the API's ConfigMap edited and its Pods replaced) and the watch caches warm."""
    if tier not in ("fast", "real"):
        print(f"--kubernetes takes fast or real, not {tier!r}")
        return 2
    subprocess.run(["cargo", "build", "--quiet", "--release", "--workspace", "--bins"], cwd=ROOT, check=True)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
    env = {**os.environ, "HARVEST_BIN_DIR": str(target)}
    up = subprocess.run(["scripts/cluster.sh", "up"] + (["--real"] if tier == "real" else []), cwd=ROOT,
                        env=env, capture_output=True, text=True)
    if up.returncode != 0:
        print(up.stderr[-3000:])
        raise Failed(f"scripts/cluster.sh up ({tier}) failed")
    exports = dict(re.findall(r"export (\w+)=(\S+)", up.stdout))
    env.update(exports)
    try:
        kubectl = lambda *args, **kw: subprocess.run(["kubectl", *args], env=env, check=True, capture_output=True,
                                                     text=True, **kw)
        if tier == "real":
            kubectl_path = (pathlib.Path(os.environ.get("HARVEST_CACHE", CACHE)) / "cluster" / "state" / "kubectl").read_text().strip()
            kubectl = lambda *args, **kw: subprocess.run([kubectl_path, *args], env=env, check=True, capture_output=True,
                                                         text=True, **kw)
        config = json.loads(kubectl("-n", "harvest-system", "get", "configmap", "harvest-api", "-o",
                                    "jsonpath={.data.api\\.json}").stdout)
        config["rate_limit"] = None
        patch = json.dumps({"data": {"api.json": json.dumps(config, indent=2)}})
        kubectl("-n", "harvest-system", "patch", "configmap", "harvest-api", "--type", "merge", "-p", patch)
        old = set(kubectl("-n", "harvest-system", "get", "pods", "-l", "app.kubernetes.io/name=harvest-api", "-o",
                          "jsonpath={.items[*].metadata.name}").stdout.split())
        kubectl("-n", "harvest-system", "delete", "pods", "-l", "app.kubernetes.io/name=harvest-api", "--wait=false")
        deadline = time.monotonic() + 180
        while True:
            pods = json.loads(kubectl("-n", "harvest-system", "get", "pods", "-l", "app.kubernetes.io/name=harvest-api",
                                      "-o", "json").stdout)["items"]
            ready = [p for p in pods if p["metadata"]["name"] not in old and any(
                c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]
            if len(ready) >= 2 and len(pods) == len(ready):
                break
            if time.monotonic() > deadline:
                raise Failed("the API's new Pods were not Ready within 180 s")
            time.sleep(0.5)
        api = exports["HARVEST_API"]
        host, port = re.match(r"http://([^:/]+):(\d+)/v1", api).groups()
        port = int(port)
        key = subprocess.run(["scripts/cluster.sh", "create-key", "bench"], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        status, job = api_call("POST", "/v1/harvest", key, {"model": "smollm2-135m", "prompts": ["a poll target"]},
                               host=host, port=port, attempts=60)
        if status != 202:
            raise Failed(f"the submit was answered {status}: {job}")
        path = f"/v1/harvest/{job['job_id']}"
        # Warm the watch caches (and both replicas) before anything is timed.
        for _ in range(400):
            status, seen = api_call("GET", path, key, host=host, port=port)
            if status != 200:
                raise Failed(f"a warm-up poll was answered {status}")
        links = len((seen.get("result") or {}).get("shard_urls", []))
        print(f"kubernetes ({tier} tier), through the harvest-api Service (2 replicas), rate limit off, "
              f"polling a {seen.get('status')} job ({links} signed shard links an answer):")
        paced_polls(host, port, path, [key])
        wrk_polls(f"http://{host}:{port}{path}", key)
        # The same polls at one API Pod's own address: the API without the test cluster's
        # Service forwarding (a userspace proxy here, where a real cluster's is the kernel's).
        pod_ip = kubectl("-n", "harvest-system", "get", "pods", "-l", "app.kubernetes.io/name=harvest-api", "-o",
                         "jsonpath={.items[0].status.podIP}").stdout.strip()
        print(f"kubernetes ({tier} tier), one API Pod at its own address ({pod_ip}:8080), rate limit off:")
        paced_polls(pod_ip, 8080, path, [key])
        wrk_polls(f"http://{pod_ip}:8080{path}", key)
    finally:
        subprocess.run(["scripts/cluster.sh", "down"], cwd=ROOT, env=env, capture_output=True)
    return 0


def api_call(method, path, key, body=None, host="127.0.0.1", port=None, attempts=1):
    """One request; `attempts` tries a refused connection again, a second apart."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{host}:{port or PORT}{path}", data=data, method=method,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)
        except OSError:
            if attempt + 1 == attempts:
                raise
            time.sleep(1)


def footprint(pid):
    rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def soak(seconds):
    """Polls paced at 1,000/s for `seconds`, beside mixed traffic with real jobs."""
    import threading
    with running_server(max_workers=1, limits={"monthly_jobs_per_key": 1000000, "daily_tokens": 1000000000}, rate_limit=None,
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
        paced_polls("127.0.0.1", PORT, target_path, [key])
        stop.set()
        for t in threads:
            t.join()
        samples.append(footprint(server.pid))
        print(f"soak: {seconds:.0f} s, mixed traffic {counts['requests']} requests, {counts['jobs']} jobs submitted")
        print(f"  server RSS KiB first {samples[0][0]}, after a quarter {samples[len(samples) // 4][0]}, last {samples[-1][0]}; "
              f"fds first {samples[0][1]}, max {max(s[1] for s in samples)}, last {samples[-1][1]}")
    return 0


def paced(host, port, path, key, per_second, seconds):
    """Polls `path` on one keep-alive connection at `per_second` for `seconds`, yielding each
    answer's status and its latency from the scheduled send time."""
    import http.client
    conn = http.client.HTTPConnection(host, port)
    start, sent = time.perf_counter(), 0
    while True:
        due = start + sent / per_second
        if due - start >= seconds:
            return
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        response.read()
        yield response.status, time.perf_counter() - due
        sent += 1


def paced_polls(host, port, path, keys, rate=1000, connections=4):
    """Status polls at a fixed rate, each connection on its own thread and schedule (and key, in
    turn from `keys`), so a slow answer delays the next request of its connection only (no
    coordinated omission: latency is counted from the scheduled send time). An answer other
    than 200 fails the run: the figures are of status answers only."""
    import threading
    seconds = float(os.environ.get("HARVEST_BENCH_PACED_S", "30"))
    per = rate / connections
    latencies, errors = [], []
    lock = threading.Lock()

    def run(key):
        mine = []
        for status, took in paced(host, port, path, key, per, seconds):
            if status != 200:
                errors.append(status)
            mine.append(took)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run, args=(keys[i % len(keys)],)) for i in range(connections)]
    begun = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - begun
    if errors:
        counts = {status: errors.count(status) for status in sorted(set(errors))}
        raise Failed(f"status polls paced at {rate}/s met {len(errors)} answers other than 200 ({counts}): no latency figure")
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
    print(f"status polls paced at {rate}/s over {connections} connections for {seconds:.0f} s: "
          f"{len(latencies) / took:.0f} requests/s done, p50 {pick(0.5):.2f} ms, p99 {pick(0.99):.2f} ms, "
          f"p99.9 {pick(0.999):.2f} ms, all 200")


if __name__ == "__main__":
    sys.exit(main())
