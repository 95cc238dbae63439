//! The pipeline fixture lives in the library (`adspend_harness::pipeline`) so
//! that the `adchaos` campaign uses the same one.

pub(crate) use adspend_harness::pipeline::*;
