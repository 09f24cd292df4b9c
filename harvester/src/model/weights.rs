//! The weights of a decoder block, declared once for every backend. A [`Form`] says how a
//! backend holds each kind of part (the loader's [`Host`] form: mapped or decoded [`Matrix`]es
//! and f32 vectors; the CUDA backend's: device buffers in the mode's type), and
//! [`BlockWeights::convert`] turns one form into another, part by part, through a [`Convert`]
//! (an upload, a rounding). What a block has beyond Llama's is optional, and the block's code
//! ([`super::block`]) runs an op where the weights hold its part: a QK norm present is the head
//! norms, whatever the family.

use std::fmt::Debug;

use super::Matrix;
use crate::error::Result;

/// How a backend holds each kind of weight.
pub trait Form {
    /// A weight matrix, in the backend's compute type.
    type Matrix: Debug + Clone;
    /// A norm's weight vector.
    type Norm: Debug + Clone;
    /// A bias, added in f32 whatever the mode.
    type Bias: Debug + Clone;
    /// A sparse block's router, whose f32 logits choose experts.
    type Router: Debug + Clone;
}

/// The loader's form: matrices in the checkpoint's precision, norms and biases in f32.
#[derive(Debug, Clone, Copy)]
pub struct Host;

impl Form for Host {
    type Matrix = Matrix;
    type Norm = Vec<f32>;
    type Bias = Vec<f32>;
    type Router = Matrix;
}

/// One decoder block's weights. Matrices are row-major `[out, in]`, as in PyTorch.
#[derive(Debug, Clone)]
pub struct BlockWeights<W: Form = Host> {
    /// Input RMSNorm weight, `[hidden]`.
    pub attn_norm: W::Norm,
    /// Q, K and V projections stacked, `[(heads + 2 kv_heads) head_dim, hidden]`.
    pub qkv: W::Matrix,
    /// Their biases, stacked likewise (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: Option<W::Bias>,
    /// RMSNorms of every query head and every key head after the QKV product (AFMoE).
    pub head_norms: Option<HeadNorms<W>>,
    /// The attention output gate, `[heads head_dim, hidden]`: the attention output is
    /// multiplied by `sigmoid(normed · gateᵀ)` (AFMoE).
    pub attn_gate: Option<W::Matrix>,
    /// Attention output projection, `[hidden, heads head_dim]`.
    pub o: W::Matrix,
    /// Its bias (Llama with `attention_bias`).
    pub o_bias: Option<W::Bias>,
    /// RMSNorms of each branch output before it joins the residual stream (AFMoE).
    pub branch_norms: Option<BranchNorms<W>>,
    /// The MLP's input RMSNorm weight (Llama's `post_attention_layernorm`, AFMoE's
    /// `pre_mlp_layernorm`), `[hidden]`.
    pub mlp_norm: W::Norm,
    /// Gate and up projections stacked, `[2 intermediate, hidden]`: the dense MLP, or a sparse
    /// block's shared experts (no rows when it has none).
    pub gate_up: W::Matrix,
    /// Down projection, `[hidden, intermediate]`.
    pub down: W::Matrix,
    /// The routed experts of a sparse block.
    pub moe: Option<MoeWeights<W>>,
}

/// The per-head RMSNorm weights applied to Q and K, `[head_dim]` each.
#[derive(Debug, Clone)]
pub struct HeadNorms<W: Form = Host> {
    /// Applied to every query head.
    pub q: W::Norm,
    /// Applied to every key head.
    pub k: W::Norm,
}

/// The RMSNorm weights of the two branch outputs, `[hidden]` each.
#[derive(Debug, Clone)]
pub struct BranchNorms<W: Form = Host> {
    /// On the attention output.
    pub attention: W::Norm,
    /// On the MLP output.
    pub mlp: W::Norm,
}

/// A sparse block's router and routed experts.
#[derive(Debug, Clone)]
pub struct MoeWeights<W: Form = Host> {
    /// Router, `[experts, hidden]`.
    pub router: W::Router,
    /// Added to the scores to choose experts (not to weight them), `[experts]`; read by the
    /// routing rule on the host in every backend.
    pub expert_bias: Vec<f32>,
    /// One SwiGLU MLP per expert.
    pub experts: Vec<Expert<W>>,
}

/// One routed expert.
#[derive(Debug, Clone)]
pub struct Expert<W: Form = Host> {
    /// Gate and up projections stacked, `[2 expert_intermediate, hidden]`.
    pub gate_up: W::Matrix,
    /// Down projection, `[hidden, expert_intermediate]`.
    pub down: W::Matrix,
}

/// Turns each kind of weight from form `A` into form `B`: a backend's upload.
pub trait Convert<A: Form, B: Form> {
    /// A weight matrix.
    fn matrix(&mut self, matrix: A::Matrix) -> Result<B::Matrix>;
    /// A norm's weights.
    fn norm(&mut self, norm: A::Norm) -> Result<B::Norm>;
    /// A bias.
    fn bias(&mut self, bias: A::Bias) -> Result<B::Bias>;
    /// A router.
    fn router(&mut self, router: A::Router) -> Result<B::Router>;
}

impl<A: Form> BlockWeights<A> {
    /// The same block in form `B`, each part converted once, in declaration order.
    pub fn convert<B: Form>(self, to: &mut impl Convert<A, B>) -> Result<BlockWeights<B>> {
        let attn_norm = to.norm(self.attn_norm)?;
        let qkv = to.matrix(self.qkv)?;
        let qkv_bias = self.qkv_bias.map(|b| to.bias(b)).transpose()?;
        let head_norms = match self.head_norms {
            Some(h) => Some(HeadNorms {
                q: to.norm(h.q)?,
                k: to.norm(h.k)?,
            }),
            None => None,
        };
        let attn_gate = self.attn_gate.map(|g| to.matrix(g)).transpose()?;
        let o = to.matrix(self.o)?;
        let o_bias = self.o_bias.map(|b| to.bias(b)).transpose()?;
        let branch_norms = match self.branch_norms {
            Some(n) => Some(BranchNorms {
                attention: to.norm(n.attention)?,
                mlp: to.norm(n.mlp)?,
            }),
            None => None,
        };
        let mlp_norm = to.norm(self.mlp_norm)?;
        let gate_up = to.matrix(self.gate_up)?;
        let down = to.matrix(self.down)?;
        let moe = match self.moe {
            Some(m) => Some(m.convert(to)?),
            None => None,
        };
        Ok(BlockWeights {
            attn_norm,
            qkv,
            qkv_bias,
            head_norms,
            attn_gate,
            o,
            o_bias,
            branch_norms,
            mlp_norm,
            gate_up,
            down,
            moe,
        })
    }
}

impl<A: Form> MoeWeights<A> {
    fn convert<B: Form>(self, to: &mut impl Convert<A, B>) -> Result<MoeWeights<B>> {
        let router = to.router(self.router)?;
        let experts = self
            .experts
            .into_iter()
            .map(|e| {
                Ok(Expert {
                    gate_up: to.matrix(e.gate_up)?,
                    down: to.matrix(e.down)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(MoeWeights {
            router,
            expert_bias: self.expert_bias,
            experts,
        })
    }
}

impl BlockWeights {
    /// Every weight matrix of the block.
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut all = vec![&self.qkv, &self.o, &self.gate_up, &self.down];
        all.extend(&self.attn_gate);
        if let Some(moe) = &self.moe {
            all.push(&moe.router);
            all.extend(moe.experts.iter().flat_map(|e| [&e.gate_up, &e.down]));
        }
        all
    }

    /// Every f32 vector of the block (norms, biases).
    pub(super) fn vectors(&self) -> Vec<&[f32]> {
        let mut all = vec![self.attn_norm.as_slice(), &self.mlp_norm];
        all.extend(self.qkv_bias.as_deref());
        all.extend(self.o_bias.as_deref());
        if let Some(h) = &self.head_norms {
            all.extend([h.q.as_slice(), &h.k]);
        }
        if let Some(n) = &self.branch_norms {
            all.extend([n.attention.as_slice(), &n.mlp]);
        }
        all.extend(self.moe.as_ref().map(|m| m.expert_bias.as_slice()));
        all
    }

    /// The MLP's inner width: the dense MLP's, or a sparse block's shared experts' (0 for
    /// none).
    pub fn mlp_width(&self) -> usize {
        self.down.cols()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A form that names each part by its kind and a counter, to see what `convert` visits.
    #[derive(Debug, Clone)]
    struct Named;

    impl Form for Named {
        type Matrix = String;
        type Norm = String;
        type Bias = String;
        type Router = String;
    }

    struct Namer(usize);

    impl Namer {
        fn name(&mut self, kind: &str) -> Result<String> {
            self.0 += 1;
            Ok(format!("{kind} {}", self.0))
        }
    }

    impl Convert<Host, Named> for Namer {
        fn matrix(&mut self, _: Matrix) -> Result<String> {
            self.name("matrix")
        }
        fn norm(&mut self, _: Vec<f32>) -> Result<String> {
            self.name("norm")
        }
        fn bias(&mut self, _: Vec<f32>) -> Result<String> {
            self.name("bias")
        }
        fn router(&mut self, _: Matrix) -> Result<String> {
            self.name("router")
        }
    }

    fn matrix() -> Matrix {
        Matrix::from_f32(1, 1, vec![1.0])
    }

    #[test]
    fn converting_a_block_converts_every_part_it_holds_once_by_its_kind() {
        let block = BlockWeights {
            attn_norm: vec![1.0],
            qkv: matrix(),
            qkv_bias: Some(vec![0.5]),
            head_norms: None,
            attn_gate: Some(matrix()),
            o: matrix(),
            o_bias: None,
            branch_norms: Some(BranchNorms {
                attention: vec![1.0],
                mlp: vec![1.0],
            }),
            mlp_norm: vec![1.0],
            gate_up: matrix(),
            down: matrix(),
            moe: Some(MoeWeights {
                router: matrix(),
                expert_bias: vec![0.25, 0.75],
                experts: vec![
                    Expert {
                        gate_up: matrix(),
                        down: matrix(),
                    };
                    2
                ],
            }),
        };
        let named = block.convert(&mut Namer(0)).unwrap();
        assert!(named.head_norms.is_none() && named.o_bias.is_none());
        assert_eq!(named.qkv_bias.as_deref(), Some("bias 3"));
        assert_eq!(named.attn_gate.as_deref(), Some("matrix 4"));
        let norms = named.branch_norms.unwrap();
        assert_eq!(
            (norms.attention.as_str(), norms.mlp.as_str()),
            ("norm 6", "norm 7")
        );
        let moe = named.moe.unwrap();
        assert_eq!(moe.router, "router 11");
        assert_eq!(
            moe.expert_bias,
            [0.25, 0.75],
            "the routing's bias stays on the host"
        );
        assert_eq!(moe.experts[1].down, "matrix 15");
        assert_eq!(named.down, "matrix 10");
    }
}
