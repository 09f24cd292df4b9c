//! Where a run's files go and how it closes: the object store (`store`), the statistics and
//! manifest (`outputs`), the commit (`commit`), `result.json` (`result`), what an earlier run left
//! (`resume`), and `harvester inspect`.

pub(super) mod commit;
pub(super) mod inspect;
pub(super) mod outputs;
pub mod result;
pub(super) mod resume;
pub mod store;
