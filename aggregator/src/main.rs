/// mimalloc keeps large freed blocks for reuse; the system allocator
/// returned them to the kernel and paid for zeroed pages on every batch.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    adspend_common::service::main::<adspend_aggregator::Validated>()
}
