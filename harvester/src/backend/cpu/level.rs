//! The CPU's kernel level: which instruction sets the CPU backend's kernels may use. Every
//! kernel asks [`Level::current`], never the CPU directly, so one setting moves them all:
//! `HARVEST_CPU_LEVEL=portable|avx2|avx512|avx512bf16|amx` caps the level below what the CPU
//! has, which lets an AVX-512 machine run (and CI test) what an AVX2 laptop or any x86-64 CPU
//! runs. Asking for more than the CPU has is refused ([`Level::configured`]); it never reaches
//! an instruction the CPU lacks.
//!
//! ```text
//! portable ─► avx2 (AVX, AVX2, FMA) ─► avx512 (+ F, BW, VL, DQ) ─► avx512bf16 (+ BF16: vdpbf16ps)
//!          ─► amx (+ AMX-TILE, AMX-BF16 and Linux's permission: the bf16 products on tiles)
//! ```
//!
//! `amx` runs only where asked for ([`AUTOMATIC_CEILING`]) until its tile kernel has been
//! checked on an AMX CPU, and only after a self-check on this CPU passes.

use std::sync::OnceLock;

use crate::error::{Error, MachineError, Result};

/// The process's level, or why the one asked for was refused ([`Level::configure`]).
static SETTING: OnceLock<std::result::Result<Level, String>> = OnceLock::new();

/// The environment variable that caps the level.
pub const LEVEL_VARIABLE: &str = "HARVEST_CPU_LEVEL";

/// The highest level chosen without [`LEVEL_VARIABLE`]: the tile kernel (`amx`) has run only on
/// its emulator (`amx::Emulated`) so far, so it runs only where a user names it.
pub const AUTOMATIC_CEILING: Level = Level::Avx512Bf16;

/// The pseudo-feature [`Level::lacking`] names when Linux refuses the tiles' register state.
const TILE_PERMISSION: &str =
    "amx_permission (Linux's arch_prctl ARCH_REQ_XCOMP_PERM for tile data, Linux 5.16 or later)";

/// A kernel level, each one a superset of the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Plain Rust for the baseline x86-64 (SSE2): any CPU.
    Portable,
    /// 256-bit vectors with FMA.
    Avx2,
    /// 512-bit vectors.
    Avx512,
    /// 512-bit vectors and the bf16 dot product `vdpbf16ps`.
    Avx512Bf16,
    /// The bf16 weight products on AMX tiles (`tdpbf16ps`).
    Amx,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Self; 5] = [
        Self::Portable,
        Self::Avx2,
        Self::Avx512,
        Self::Avx512Bf16,
        Self::Amx,
    ];

    /// Its name, as [`LEVEL_VARIABLE`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Avx512Bf16 => "avx512bf16",
            Self::Amx => "amx",
        }
    }

    /// The CPU features (as `/proc/cpuinfo` spells them) this level needs beyond the one below.
    fn features(self) -> &'static [&'static str] {
        match self {
            Self::Portable => &[],
            Self::Avx2 => &["avx", "avx2", "fma"],
            Self::Avx512 => &["avx512f", "avx512bw", "avx512vl", "avx512dq"],
            Self::Avx512Bf16 => &["avx512_bf16"],
            Self::Amx => &["amx_tile", "amx_bf16", TILE_PERMISSION],
        }
    }

    /// The features this CPU lacks for `self` and every level below it: empty when it runs it.
    pub fn lacking(self) -> Vec<&'static str> {
        Self::ALL
            .into_iter()
            .filter(|&level| level <= self)
            .flat_map(Self::features)
            .copied()
            .filter(|&feature| !cpu_has(feature))
            .collect()
    }

    /// The highest level this CPU runs.
    pub fn detected() -> Self {
        static DETECTED: OnceLock<Level> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            Self::ALL
                .into_iter()
                .rev()
                .find(|level| level.lacking().is_empty())
                .unwrap_or(Self::Portable)
        })
    }

    /// The level the kernels run at when [`LEVEL_VARIABLE`] is unset: the CPU's, up to
    /// [`AUTOMATIC_CEILING`].
    pub fn automatic() -> Self {
        Self::detected().min(AUTOMATIC_CEILING)
    }

    /// The level `forced` (the value of [`LEVEL_VARIABLE`]) asks for on a CPU whose highest is
    /// `detected`: `detected` up to [`AUTOMATIC_CEILING`] when unset; an error naming the
    /// value when it is not a level or asks for more than the CPU has.
    pub fn choose(forced: Option<&str>, detected: Self) -> Result<Self> {
        let Some(text) = forced.map(str::trim).filter(|t| !t.is_empty()) else {
            return Ok(detected.min(AUTOMATIC_CEILING));
        };
        let names = || Self::ALL.map(Self::name).join(", ");
        let level = Self::ALL
            .into_iter()
            .find(|level| level.name() == text)
            .ok_or_else(|| Error::Machine(MachineError::CpuLevel {
                reason: format!(
                    "{LEVEL_VARIABLE}={text:?} is not a kernel level: use one of {}, or unset it",
                    names()
                ),
            }))?;
        if level > detected {
            return Err(Error::Machine(MachineError::CpuLevel {
                reason: format!(
                    "{LEVEL_VARIABLE}={text} asks for more than this CPU has (it lacks {}; its highest level is {}): use a level up to {}, or unset it",
                    level.lacking().join(", "),
                    detected.name(),
                    detected.name()
                ),
            }));
        }
        Ok(level)
    }

    /// Sets the level the kernels run at for this process from `forced`, the value of
    /// [`LEVEL_VARIABLE`] that `main` reads: the first call decides. A refused value leaves the
    /// kernels at the detected level, and [`Level::configured`] says why wherever a CPU
    /// backend is built, so that a job is refused before any work.
    pub fn configure(forced: Option<&str>) -> Result<Self> {
        let chosen = Self::choose(forced, Self::detected()).and_then(checked);
        let setting = match &chosen {
            Ok(level) => Ok(*level),
            Err(Error::Machine(MachineError::CpuLevel { reason })) => Err(reason.clone()),
            Err(other) => Err(other.to_string()),
        };
        // Only the first call decides, so the kernels never change level mid-run.
        let _ = SETTING.set(setting);
        chosen
    }

    /// The level [`Level::configure`] set, or its refusal. Never configured: the detected level
    /// (a test harness configures it from the environment; see `tests/common`).
    pub fn configured() -> Result<Self> {
        match Self::setting() {
            Ok(level) => Ok(*level),
            Err(reason) => Err(Error::Machine(MachineError::CpuLevel {
                reason: reason.clone(),
            })),
        }
    }

    /// The level the kernels run at: the configured one, or the detected level where that is
    /// refused (the entry point has already said why).
    pub fn current() -> Self {
        match Self::setting() {
            Ok(level) => *level,
            Err(_) => Self::automatic(),
        }
    }

    fn setting() -> &'static std::result::Result<Level, String> {
        // The library's own unit tests run at the level scripts/test.sh forces.
        #[cfg(test)]
        {
            static FROM_ENVIRONMENT: std::sync::Once = std::sync::Once::new();
            FROM_ENVIRONMENT.call_once(|| {
                let _ = Self::configure(std::env::var(LEVEL_VARIABLE).ok().as_deref());
            });
        }
        SETTING.get_or_init(|| Ok(Self::automatic()))
    }

    /// Whether the kernels may use `self`'s instructions now.
    pub fn enabled(self) -> bool {
        Self::current() >= self
    }
}

/// `level`, once its kernels have passed their check on this CPU: `amx`'s tile kernel must give
/// the emulator's bits on exact sums ([`super::amx::self_check`]) before any work runs on it.
fn checked(level: Level) -> Result<Level> {
    if level != Level::Amx {
        return Ok(level);
    }
    match super::amx::self_check() {
        Ok(()) => Ok(level),
        Err(failure) => Err(Error::Machine(MachineError::CpuLevel {
            reason: format!(
                "{LEVEL_VARIABLE}=amx: {failure}; use {LEVEL_VARIABLE}=avx512bf16, or unset it, and report this CPU (harvester cpu-info)"
            ),
        })),
    }
}

/// What `harvester cpu-info` prints: the CPU's level, the one the kernels run at, and what
/// the CPU lacks for each level.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LevelReport {
    /// The highest level this CPU runs.
    pub detected: &'static str,
    /// The level the kernels run at (capped by [`LEVEL_VARIABLE`]).
    pub running: &'static str,
    /// Each level, lowest first.
    pub levels: Vec<LevelSupport>,
}

/// One level on this CPU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LevelSupport {
    /// Its name.
    pub level: &'static str,
    /// Whether this CPU runs it.
    pub runs: bool,
    /// The CPU features it lacks for it.
    pub lacks: Vec<&'static str>,
}

/// This CPU's levels; refuses a bad [`LEVEL_VARIABLE`] as [`Level::configured`] does.
pub fn report() -> Result<LevelReport> {
    Ok(LevelReport {
        detected: Level::detected().name(),
        running: Level::configured()?.name(),
        levels: Level::ALL
            .into_iter()
            .map(|level| LevelSupport {
                level: level.name(),
                runs: level.lacking().is_empty(),
                lacks: level.lacking(),
            })
            .collect(),
    })
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the CPU has `feature` (spelled as in `/proc/cpuinfo`).
fn cpu_has(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        match feature {
            "avx" => has!("avx"),
            "avx2" => has!("avx2"),
            "fma" => has!("fma"),
            "avx512f" => has!("avx512f"),
            "avx512bw" => has!("avx512bw"),
            "avx512vl" => has!("avx512vl"),
            "avx512dq" => has!("avx512dq"),
            "avx512_bf16" => has!("avx512bf16"),
            "amx_tile" => super::amx::cpu_has_tiles().0,
            "amx_bf16" => super::amx::cpu_has_tiles().1,
            // Asked for only where the CPU has tiles: elsewhere `amx_tile` is what it lacks.
            TILE_PERMISSION => {
                !super::amx::cpu_has_tiles().0 || super::amx::request_permission().is_ok()
            }
            _ => false,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = feature;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_each_needs_the_features_below_it() {
        assert!(Level::Portable < Level::Avx2 && Level::Avx512 < Level::Avx512Bf16);
        assert!(
            Level::Portable.lacking().is_empty(),
            "every CPU runs portable"
        );
        let detected = Level::detected();
        for level in Level::ALL {
            assert_eq!(level.lacking().is_empty(), level <= detected, "{level}");
        }
    }

    #[test]
    fn an_unset_level_is_the_cpus_and_a_lower_one_is_taken() {
        assert_eq!(Level::choose(None, Level::Avx512).unwrap(), Level::Avx512);
        assert_eq!(Level::choose(Some(" "), Level::Avx2).unwrap(), Level::Avx2);
        assert_eq!(
            Level::choose(Some("avx2"), Level::Avx512Bf16).unwrap(),
            Level::Avx2
        );
        assert_eq!(
            Level::choose(Some("portable"), Level::Portable).unwrap(),
            Level::Portable
        );
    }

    #[test]
    fn amx_runs_only_where_it_is_named_and_is_refused_by_name_on_a_cpu_without_it() {
        assert_eq!(
            Level::choose(None, Level::Amx).unwrap(),
            Level::Avx512Bf16,
            "unset, the tiles wait until they are checked on AMX hardware"
        );
        assert_eq!(Level::choose(Some("amx"), Level::Amx).unwrap(), Level::Amx);
        let error = Level::choose(Some("amx"), Level::Avx512Bf16)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("HARVEST_CPU_LEVEL=amx") && error.contains("up to avx512bf16"),
            "{error}"
        );
        if !amx_cpu() {
            assert!(error.contains("amx_tile"), "{error}");
        }
    }

    fn amx_cpu() -> bool {
        let (tile, bf16) = crate::backend::cpu::amx::cpu_has_tiles();
        tile && bf16
    }

    #[test]
    fn a_level_above_the_cpus_or_an_unknown_one_is_refused_by_name() {
        let error = Level::choose(Some("avx512bf16"), Level::Avx2)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("HARVEST_CPU_LEVEL=avx512bf16") && error.contains("up to avx2"),
            "{error}"
        );
        let error = Level::choose(Some("sse4"), Level::Avx2)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("\"sse4\"") && error.contains("portable, avx2, avx512, avx512bf16, amx"),
            "{error}"
        );
    }

    #[test]
    fn the_running_level_never_exceeds_the_cpus() {
        assert!(Level::current() <= Level::detected());
        // A CI run that forces a level must run at it, or fail here: a forced level the CPU
        // lacks is never reported as tested.
        if let Ok(forced) = std::env::var(LEVEL_VARIABLE) {
            assert_eq!(
                Level::current().name(),
                forced.trim(),
                "{}",
                Level::configured().map_or_else(|e| e.to_string(), |_| String::new())
            );
        }
    }
}
