//! Properties of the CPU forward pass on tiny seeded random-weight models: early exit, batch
//! invariance, causality, GQA layouts, hook sites and projections.

#![allow(clippy::unwrap_used)]

mod common;

use common::{Shape, WriteTiny, capture, capture_sites, prompts, tiny_model, worst_relative_error};
use harvest_core::{LayerSelection, Site, Sites};
use harvester::backend::cpu::CpuBackend;
use harvester::backend::{Backend, Batch, CaptureSpec, Captured};
use harvester::model::LlamaWeights;
use harvester::projection::Directions;

fn tiny(model: &Shape, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    model.write(dir.path(), seed);
    dir
}

#[test]
fn stopping_early_gives_the_same_block_output_as_running_every_block() {
    let dir = tiny(&tiny_model(), 1);
    let all = capture(dir.path(), &LayerSelection::All, &prompts());
    let first = capture(dir.path(), &LayerSelection::Explicit(vec![0]), &prompts());
    assert_eq!(all.layers, 3);
    assert_eq!(first.layers, 1);
    assert_eq!(first.layer(0), all.layer(0));
    let partial = LlamaWeights::load(dir.path(), Some(2)).unwrap();
    assert_eq!(partial.blocks.len(), 2, "only the blocks needed are loaded");
}

#[test]
fn the_sites_of_one_pass_add_up_and_keeping_them_leaves_the_block_output_unchanged() {
    let dir = tiny(&tiny_model(), 11);
    let every = Sites::new(&Site::ALL).unwrap();
    let layers = LayerSelection::Explicit(vec![0, 2]);
    let sites = capture_sites(dir.path(), &layers, every.clone(), &prompts());
    let alone = capture(dir.path(), &layers, &prompts());
    assert_eq!((sites.sites, sites.layers), (5, 2));
    let at = |site, layer| sites.layer(sites.slot(every.position(site).unwrap(), layer));
    let sum = |a: &[f32], b: &[f32]| -> Vec<f32> { a.iter().zip(b).map(|(x, y)| x + y).collect() };
    for layer in 0..2 {
        let mid = sum(at(Site::ResidPre, layer), at(Site::AttnOut, layer));
        assert_eq!(
            at(Site::ResidMid, layer),
            mid,
            "layer {layer}: pre + attn_out"
        );
        let post = sum(at(Site::ResidMid, layer), at(Site::MlpOut, layer));
        assert_eq!(
            at(Site::ResidPost, layer),
            post,
            "layer {layer}: mid + mlp_out"
        );
        assert_eq!(
            at(Site::ResidPost, layer),
            alone.layer(layer),
            "layer {layer}: keeping other sites moved resid_post"
        );
        assert_ne!(at(Site::AttnOut, layer), at(Site::MlpOut, layer));
    }
    // Block 2's input is block 1's output, which the resid_post-alone run does not keep.
    let block1 = capture(dir.path(), &LayerSelection::Explicit(vec![1]), &prompts());
    assert_eq!(at(Site::ResidPre, 1), block1.layer(0));
}

#[test]
fn the_bf16_mode_is_batch_invariant_and_close_to_f32() {
    use harvest_core::plan::Precision;
    let dir = tiny(&tiny_model(), 12);
    let prompts = prompts();
    let every = Sites::default();
    let packed = common::capture_in(
        dir.path(),
        &LayerSelection::All,
        every.clone(),
        Precision::Bf16,
        &prompts,
    );
    let f32s = capture(dir.path(), &LayerSelection::All, &prompts);
    let mut offset = 0;
    for prompt in &prompts {
        let alone = common::capture_in(
            dir.path(),
            &LayerSelection::All,
            every.clone(),
            Precision::Bf16,
            std::slice::from_ref(prompt),
        );
        for layer in 0..3 {
            let together = packed.rows(layer, offset..offset + prompt.len());
            assert_eq!(
                together,
                alone.layer(layer),
                "layer {layer}: the same bits in any batch"
            );
        }
        offset += prompt.len();
    }
    let error = worst_relative_error(&packed.data, &f32s.data, packed.width);
    assert!(error > 0.0 && error < 2e-2, "bf16 against f32: {error:e}");
}

#[test]
fn a_prompt_gives_the_same_bits_alone_as_packed_with_others() {
    let dir = tiny(&tiny_model(), 2);
    let prompts = prompts();
    let packed = capture(dir.path(), &LayerSelection::All, &prompts);
    let mut offset = 0;
    for prompt in &prompts {
        let alone = capture(
            dir.path(),
            &LayerSelection::All,
            std::slice::from_ref(prompt),
        );
        for layer in 0..3 {
            let together = packed.rows(layer, offset..offset + prompt.len());
            assert_eq!(together, alone.layer(layer), "layer {layer}");
        }
        offset += prompt.len();
    }
}

#[test]
fn every_thread_count_gives_the_same_bits_in_both_precisions() {
    use harvest_core::plan::Precision;
    // Wide enough that the products split over threads (not the serial path of small ones).
    let model = Shape {
        hidden: 256,
        intermediate: 512,
        heads: 8,
        kv_heads: 4,
        ..tiny_model()
    };
    let dir = tiny(&model, 21);
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|p| (0..90).map(|i| ((i * 11 + p * 5) % 64) as u32).collect())
        .collect();
    for precision in [Precision::F32, Precision::Bf16] {
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                common::capture_in(
                    dir.path(),
                    &LayerSelection::All,
                    Sites::default(),
                    precision,
                    &prompts,
                )
            })
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(
                run(threads).data == one.data,
                "{precision:?}: {threads} threads against 1"
            );
        }
    }
}

#[test]
fn later_tokens_never_change_earlier_activations() {
    let dir = tiny(&tiny_model(), 3);
    let long: Vec<u32> = (0..100).map(|i| (i * 13 % 64) as u32).collect();
    let full = capture(
        dir.path(),
        &LayerSelection::All,
        std::slice::from_ref(&long),
    );
    let prefix = capture(dir.path(), &LayerSelection::All, &[long[..70].to_vec()]);
    let error = worst_relative_error(full.rows(2, 0..70), prefix.layer(2), full.width);
    assert!(error < 1e-6, "{error:e}");
}

#[test]
fn grouped_query_layouts_from_multi_head_to_single_kv_head_all_run() {
    for kv_heads in [1, 2, 4] {
        let model = Shape {
            kv_heads,
            ..tiny_model()
        };
        let dir = tiny(&model, 4);
        let out = capture(dir.path(), &LayerSelection::Quartiles, &prompts());
        let tokens: usize = prompts().iter().map(Vec::len).sum();
        assert_eq!(
            (out.layers, out.tokens, out.width),
            (3, tokens, 32),
            "kv_heads {kv_heads}"
        );
        assert!(out.data.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn projections_equal_activations_times_unit_directions() {
    let dir = tiny(&tiny_model(), 5);
    let raw = capture(
        dir.path(),
        &LayerSelection::Explicit(vec![0, 2]),
        &prompts(),
    );
    let values: Vec<f32> = (0..3 * 32)
        .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
        .collect();
    let directions = Directions::new(&values, 3, 32, 32).unwrap();
    let weights = LlamaWeights::load(dir.path(), None).unwrap();
    let layers = LayerSelection::Explicit(vec![0, 2]).resolve(3).unwrap();
    let spec = CaptureSpec {
        layers,
        sites: Sites::default(),
        precision: Default::default(),
        directions: Some(directions.clone()),
    };
    let mut backend = CpuBackend::new(weights, spec).unwrap();
    assert_eq!(backend.capture_width(), 3);
    let mut projected = Captured::default();
    backend
        .capture(&Batch::from_sequences(&prompts()), &mut projected)
        .unwrap();
    let units = directions.unit_vectors();
    let mut expected = Vec::new();
    for layer in 0..2 {
        for row in raw.layer(layer).chunks_exact(32) {
            for d in units.chunks_exact(32) {
                expected.push(
                    row.iter()
                        .zip(d)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>() as f32,
                );
            }
        }
    }
    let error = worst_relative_error(&projected.data, &expected, 3);
    assert!(error < 1e-5, "{error:e}");
}

#[test]
fn reused_buffers_give_identical_results_across_batches_of_different_sizes() {
    let dir = tiny(&tiny_model(), 6);
    let mut backend =
        CpuBackend::load(dir.path(), &LayerSelection::All, Sites::default(), None).unwrap();
    let small = Batch::from_sequences(&[vec![4, 5, 6]]);
    let mut first = Captured::default();
    backend.capture(&small, &mut first).unwrap();
    let mut out = Captured::default();
    backend
        .capture(&Batch::from_sequences(&prompts()), &mut out)
        .unwrap();
    backend.capture(&small, &mut out).unwrap();
    assert_eq!(out.data, first.data);
}

/// The bf16 checkpoint `synth` writes for `shape`, and the same weights widened to f32.
fn bf16_and_f32(shape: Shape) -> (tempfile::TempDir, tempfile::TempDir) {
    let half = tempfile::tempdir().unwrap();
    harvester::synth::write(shape, half.path(), 5).unwrap();
    let full = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(half.path().join("model.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let widened: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16);
            let f32s: Vec<u8> = view
                .data()
                .chunks_exact(2)
                .flat_map(|b| {
                    f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16).to_le_bytes()
                })
                .collect();
            (name, view.shape().to_vec(), f32s)
        })
        .collect();
    let views: Vec<_> = widened
        .iter()
        .map(|(n, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &full.path().join("model.safetensors")).unwrap();
    std::fs::copy(
        half.path().join("config.json"),
        full.path().join("config.json"),
    )
    .unwrap();
    (half, full)
}

#[test]
fn bf16_weights_stay_half_size_in_memory_and_give_the_same_bits_as_their_f32_widening() {
    let (half, full) = bf16_and_f32(tiny_model());
    let kept = LlamaWeights::load(half.path(), None).unwrap();
    let decoded = LlamaWeights::load(full.path(), None).unwrap();
    let block = &kept.blocks[1];
    for matrix in [
        &block.qkv,
        &block.o,
        &block.gate_up,
        &block.down,
        &kept.embed,
    ] {
        assert_eq!(matrix.half(), Some(harvester::model::Half::Bf16));
        assert_eq!(matrix.resident_bytes(), 2 * matrix.len() as u64);
    }
    assert!(decoded.blocks[1].gate_up.as_f32().is_some());
    assert_eq!(
        kept.blocks[1].gate_up.to_f32_vec(),
        decoded.blocks[1].gate_up.as_f32().unwrap()
    );
    assert!(kept.resident_bytes() * 2 > decoded.resident_bytes() * 9 / 10);
    assert!(kept.resident_bytes() < decoded.resident_bytes() * 6 / 10);
    let from_half = capture(half.path(), &LayerSelection::All, &prompts());
    let from_full = capture(full.path(), &LayerSelection::All, &prompts());
    assert_eq!(from_half.data, from_full.data, "bit for bit");
}

#[test]
fn the_cpu_kernels_run_at_the_level_the_environment_forces() {
    use harvester::backend::cpu::level::{LEVEL_VARIABLE, Level};
    let level = common::cpu_level();
    assert!(level <= Level::detected());
    // scripts/test.sh runs these tests again at each level: a level never reached is never
    // reported as tested.
    if let Ok(forced) = std::env::var(LEVEL_VARIABLE) {
        assert_eq!(level.name(), forced.trim());
    }
}
