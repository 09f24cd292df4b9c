use super::*;
use crate::model::weights::{BranchNorms, Expert};

/// Weights that are their own names.
#[derive(Debug, Clone)]
struct Named;

impl Form for Named {
    type Matrix = &'static str;
    type Norm = &'static str;
    type Bias = &'static str;
    type Router = &'static str;
}

/// Records the ops it is asked to run, with the weights each is handed.
#[derive(Default)]
struct Log(Vec<String>);

impl Log {
    fn push(&mut self, op: impl Into<String>) -> Result<()> {
        self.0.push(op.into());
        Ok(())
    }
}

impl<'w> BlockOps<'w, Named> for Log {
    fn embed(&mut self, scale: f32) -> Result<()> {
        self.push(format!("embed × {scale}"))
    }
    fn norm(&mut self, weight: &&str, sublayer: Sublayer) -> Result<()> {
        self.push(format!("norm {sublayer:?} {weight}"))
    }
    fn qkv(&mut self, weight: &&str, bias: Option<&&str>) -> Result<()> {
        match bias {
            Some(bias) => self.push(format!("{weight} + {bias}")),
            None => self.push(*weight),
        }
    }
    fn head_norms(&mut self, norms: &HeadNorms<Named>) -> Result<()> {
        self.push(format!("head norms {} {}", norms.q, norms.k))
    }
    fn rope(&mut self) -> Result<()> {
        self.push("rope")
    }
    fn attention(&mut self, window: Option<usize>) -> Result<()> {
        self.push(window.map_or("attention".into(), |w| format!("attention, window {w}")))
    }
    fn attention_gate(&mut self, weight: &&str) -> Result<()> {
        self.push(*weight)
    }
    fn gate_up(&mut self, weight: &&str, width: usize) -> Result<()> {
        self.push(format!("{weight} {width}"))
    }
    fn swiglu(&mut self) -> Result<()> {
        self.push("swiglu")
    }
    fn output_into_residual(&mut self, weight: &&str, sublayer: Sublayer) -> Result<()> {
        self.push(format!("x += {sublayer:?} {weight}"))
    }
    fn output_apart(&mut self, weight: &&str, bias: Option<&&str>, _: Sublayer) -> Result<()> {
        match bias {
            Some(bias) => self.push(format!("branch = {weight} + {bias}")),
            None => self.push(format!("branch = {weight}")),
        }
    }
    fn branch_norm(&mut self, weight: &&str) -> Result<()> {
        self.push(format!("branch norm {weight}"))
    }
    fn clear_branch(&mut self) -> Result<()> {
        self.push("branch = 0")
    }
    fn routed_experts(
        &mut self,
        moe: &MoeWeights<Named>,
        norm: &&str,
        route: Option<usize>,
    ) -> Result<()> {
        assert_eq!(*norm, "mlp_norm", "the router's input is the MLP's norm");
        let experts = moe.experts.len();
        match route {
            Some(slot) => self.push(format!("branch += {experts} experts, routes in {slot}")),
            None => self.push(format!("branch += {experts} experts")),
        }
    }
    fn add_branch(&mut self) -> Result<()> {
        self.push("x += branch")
    }
    fn keep(&mut self, source: Source, slot: usize) -> Result<()> {
        self.push(format!("keep {source:?} in {slot}"))
    }
}

/// Llama's block: no bias, norm, gate or experts.
fn llama() -> BlockWeights<Named> {
    BlockWeights {
        attn_norm: "attn_norm",
        qkv: "qkv",
        qkv_bias: None,
        head_norms: None,
        attn_gate: None,
        o: "o",
        o_bias: None,
        branch_norms: None,
        mlp_norm: "mlp_norm",
        gate_up: "gate_up",
        down: "down",
        moe: None,
    }
}

/// AFMoE's dense block.
fn afmoe() -> BlockWeights<Named> {
    BlockWeights {
        head_norms: Some(HeadNorms {
            q: "q_norm",
            k: "k_norm",
        }),
        attn_gate: Some("gate"),
        branch_norms: Some(BranchNorms {
            attention: "attn_out_norm",
            mlp: "mlp_out_norm",
        }),
        ..llama()
    }
}

/// AFMoE's sparse block.
fn sparse() -> BlockWeights<Named> {
    let expert = Expert {
        gate_up: "expert gate_up",
        down: "expert down",
    };
    BlockWeights {
        moe: Some(MoeWeights {
            router: "router",
            expert_bias: Vec::new(),
            experts: vec![expert; 2],
        }),
        ..afmoe()
    }
}

const ROTARY: Layer = Layer {
    window: None,
    rotary: true,
    mlp_width: 8,
};

const FULL: Layer = Layer {
    rotary: false,
    ..ROTARY
};

fn every_site(site: Site) -> Option<usize> {
    Site::ALL.iter().position(|&s| s == site)
}

fn run(w: &BlockWeights<Named>, layer: Layer, slot: fn(Site) -> Option<usize>) -> Vec<String> {
    let mut log = Log::default();
    block(&mut log, w, layer, slot, None).unwrap();
    log.0
}

#[test]
fn a_block_keeping_no_site_adds_each_branch_in_its_projection() {
    assert_eq!(
        run(&llama(), ROTARY, |_| None),
        [
            "norm Attention attn_norm",
            "qkv",
            "rope",
            "attention",
            "x += Attention o",
            "norm Mlp mlp_norm",
            "gate_up 8",
            "swiglu",
            "x += Mlp down"
        ]
    );
}

#[test]
fn every_site_is_kept_where_the_block_computes_it_and_branches_are_kept_before_they_join() {
    let windowed = Layer {
        window: Some(8),
        ..ROTARY
    };
    assert_eq!(
        run(&llama(), windowed, every_site),
        [
            "keep Residual in 0",
            "norm Attention attn_norm",
            "qkv",
            "rope",
            "attention, window 8",
            "branch = o",
            "keep Branch in 1",
            "x += branch",
            "keep Residual in 2",
            "norm Mlp mlp_norm",
            "gate_up 8",
            "swiglu",
            "branch = down",
            "keep Branch in 3",
            "x += branch",
            "keep Residual in 4"
        ]
    );
}

#[test]
fn biases_are_handed_with_their_products_and_an_o_bias_joins_through_the_branch() {
    let biased = BlockWeights {
        qkv_bias: Some("qkv_bias"),
        o_bias: Some("o_bias"),
        ..llama()
    };
    let ops = run(&biased, ROTARY, |_| None);
    assert_eq!(
        ops[1..7],
        [
            "qkv + qkv_bias",
            "rope",
            "attention",
            "branch = o + o_bias",
            "x += branch",
            "norm Mlp mlp_norm"
        ]
    );
    assert_eq!(ops.last().map(String::as_str), Some("x += Mlp down"));
}

#[test]
fn a_full_attention_afmoe_block_skips_rope_and_norms_both_branches_before_they_join() {
    assert_eq!(
        run(&afmoe(), FULL, |_| None),
        [
            "norm Attention attn_norm",
            "qkv",
            "head norms q_norm k_norm",
            "attention",
            "gate",
            "branch = o",
            "branch norm attn_out_norm",
            "x += branch",
            "norm Mlp mlp_norm",
            "gate_up 8",
            "swiglu",
            "branch = down",
            "branch norm mlp_out_norm",
            "x += branch"
        ]
    );
}

#[test]
fn qk_norms_alone_make_a_dense_block_norm_its_heads_before_rope() {
    let qk_normed = BlockWeights {
        head_norms: afmoe().head_norms,
        ..llama()
    };
    let ops = run(&qk_normed, ROTARY, |_| None);
    assert_eq!(ops[1..4], ["qkv", "head norms q_norm k_norm", "rope"]);
    assert_eq!(ops[5], "x += Attention o", "no gate and no branch norm");
}

#[test]
fn a_sliding_sparse_block_rotates_and_adds_its_experts_to_the_shared_ones_before_the_norm() {
    let layer = Layer {
        window: Some(6),
        ..ROTARY
    };
    let mut log = Log::default();
    block(&mut log, &sparse(), layer, every_site, Some(1)).unwrap();
    let ops: Vec<&str> = log.0.iter().map(String::as_str).collect();
    assert_eq!(
        ops[3..6],
        ["head norms q_norm k_norm", "rope", "attention, window 6"]
    );
    assert_eq!(
        ops[8..10],
        ["branch norm attn_out_norm", "keep Branch in 1"]
    );
    assert_eq!(
        ops[ops.len() - 7..],
        [
            "swiglu",
            "branch = down",
            "branch += 2 experts, routes in 1",
            "branch norm mlp_out_norm",
            "keep Branch in 3",
            "x += branch",
            "keep Residual in 4"
        ]
    );
}

#[test]
fn a_sparse_block_without_shared_experts_starts_its_branch_at_zero() {
    let layer = Layer {
        mlp_width: 0,
        ..FULL
    };
    let ops = run(&sparse(), layer, |_| None);
    assert_eq!(
        ops[ops.len() - 5..],
        [
            "norm Mlp mlp_norm",
            "branch = 0",
            "branch += 2 experts",
            "branch norm mlp_out_norm",
            "x += branch"
        ]
    );
}

fn fixture_config(name: &str) -> ModelConfig {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    ModelConfig::from_file(&dir.join(name).join("config.json")).unwrap()
}

#[test]
fn the_pass_embeds_on_the_first_stage_only_and_stops_after_the_deepest_kept_block() {
    let config = fixture_config("tiny-afmoe-bf16");
    let blocks: Vec<_> = (0..config.num_layers)
        .map(|i| {
            if config.is_sparse(i) {
                sparse()
            } else {
                afmoe()
            }
        })
        .collect();
    let layers = Layers::from(vec![1, 3]);
    let sites = Sites::parse(&["resid_post", "router"]).unwrap();
    let keeps = Keeps {
        layers: &layers,
        sites: &sites,
    };
    let pass = |first_block: usize| {
        let mut log = Log::default();
        let stack = Stack {
            config: &config,
            first_block,
            blocks: &blocks[first_block..],
        };
        forward(&mut log, stack, keeps).unwrap();
        log.0
    };
    let whole = pass(0);
    let scale = config.embedding_scale();
    assert_ne!(scale, 1.0, "AFMoE scales its embedding");
    assert_eq!(whole[0], format!("embed × {scale}"));
    let kept: Vec<&String> = whole.iter().filter(|op| op.starts_with("keep")).collect();
    // Slots number site by layer over the whole job: resid_post of layers 1 and 3.
    assert_eq!(kept, ["keep Residual in 0", "keep Residual in 1"]);
    let routes: Vec<&String> = whole.iter().filter(|op| op.contains("routes")).collect();
    assert_eq!(
        routes,
        ["branch += 2 experts, routes in 0"],
        "block 3 alone is sparse and kept"
    );
    assert_eq!(
        whole
            .iter()
            .filter(|op| op.starts_with("norm Attention"))
            .count(),
        4,
        "blocks 0 to 3, not 4"
    );
    let later = pass(2);
    assert!(!later.iter().any(|op| op.starts_with("embed")));
    let kept: Vec<&String> = later.iter().filter(|op| op.starts_with("keep")).collect();
    assert_eq!(
        kept,
        ["keep Residual in 1"],
        "the job's slot, not the stage's"
    );
}
