//! Shards assembled from the forward pass's captures (`shard`), the tokens each keeps (`select`),
//! and the shuffled layout's training files made from them (`shuffle`).

pub(super) mod select;
pub mod shard;
pub(super) mod shuffle;
