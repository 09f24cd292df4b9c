//! The CUDA backend's switches: the environment variables that force a choice it would make
//! itself (the attention kernel, the kernels' form, the upload path, the batch tail) or let a feature run that
//! no GPU window has checked yet (AFMoE, f32, pipeline stages). `main` reads them once
//! ([`super::CudaSetup::from_vars`]) and hands them in with [`super::configure`]; the backend
//! asks here, never the environment.

use std::sync::OnceLock;

/// The switches that were set, by variable name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Switches(Vec<(&'static str, String)>);

impl Switches {
    /// The variables of `names` that `var` says are set (to anything but blanks).
    pub fn from_vars(names: &[&'static str], var: impl Fn(&str) -> Option<String>) -> Self {
        Self(
            names
                .iter()
                .filter_map(|&name| {
                    var(name)
                        .filter(|value| !value.trim().is_empty())
                        .map(|value| (name, value))
                })
                .collect(),
        )
    }

    /// The value of switch `name`, if set.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, value)| value.as_str())
    }
}

static CONFIGURED: OnceLock<Switches> = OnceLock::new();

/// Sets the process's switches, once (later calls are ignored).
pub(super) fn configure(switches: Switches) {
    let _ = CONFIGURED.set(switches);
}

/// The value of switch `name` as `main` handed it in; none before [`super::configure`] or when
/// unset.
pub fn switch(name: &str) -> Option<String> {
    CONFIGURED
        .get()
        .and_then(|switches| switches.get(name))
        .map(str::to_owned)
}
