// sample.metal, unmodified, compiled for the emulator.
#include "invoke.h"
#include "sample.metal"

void tvm_register_sample() { tvm::add_kernel("sample_rows", "sample_rows", &tvm::invoke<sample_rows>); }
