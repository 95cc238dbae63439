//! The pipeline fixture lives in the library (`adspend_tests::pipeline`) so
//! that the `adchaos` campaign uses the same one.

pub use adspend_tests::pipeline::*;
