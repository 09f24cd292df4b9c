//! Our f32 weight product (`sgemm`) beside the `gemm` crate on the products of SmolLM2-135M and
//! llama-8b, and our bf16 product (`vdpbf16ps` where the CPU has it) on the same shapes, packing
//! the weight as it runs and with the weight packed at load as the engine does, in one run:
//! GFLOP/s, best of several alternating rounds, with the CPU's flags.
//!
//!     cargo run --release -p harvester --example sgemm_bench [-- --threads N --rows M]
#![allow(clippy::print_stdout)]

use harvester::backend::cpu::sgemm::Kernel;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let threads = flag("--threads", 2);
    let rows = flag("--rows", 4096);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("the first pool");
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = flags
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"];
    let shown: Vec<&str> = wanted.into_iter().filter(|f| flags.contains(f)).collect();
    println!(
        "cpu flags: {}; kernel: {}; threads: {threads}; rows (tokens): {rows}",
        shown.join(" "),
        Kernel::detect().name()
    );
    println!(
        "{:<36}{:>12}{:>14}{:>8}{:>18}{:>18}",
        "product [m x k]·[k x n]",
        "ours GFLOP/s",
        "gemm GFLOP/s",
        "ratio",
        "ours bf16 GFLOP/s",
        "packed at load"
    );
    let shapes: Vec<(&str, usize, usize)> = if args.iter().any(|a| a == "--cache") {
        vec![("in cache", 128, 256)]
    } else {
        vec![
            ("smollm2 qkv", 960, 576),
            ("smollm2 o", 576, 576),
            ("smollm2 gate|up", 3072, 576),
            ("smollm2 down", 576, 1536),
            ("llama-8b qkv", 6144, 4096),
            ("llama-8b gate|up", 28672, 4096),
            ("llama-8b down", 4096, 14336),
        ]
    };
    for (name, n, k) in shapes {
        let m = rows;
        let flop = 2.0 * (m * n * k) as f64;
        let rounds = ((2e11 / flop) as usize).clamp(3, 2000);
        let [ours, theirs, bf16, at_load] = harvester::bench::gemm_rates([m, n, k], rounds);
        println!(
            "{:<36}{ours:>12.1}{theirs:>14.1}{:>7.2}x{bf16:>18.1}{at_load:>18.1}",
            format!("{name} [{m}x{k}]·[{k}x{n}]"),
            ours / theirs
        );
    }
}
