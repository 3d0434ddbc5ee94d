// When the CPU launchers use more than one OpenMP thread (fused_cpu.cc, adamw_cpu.cc, grad_norm_cpu.cc;
// attention_cpu.cc counts the multiply-adds of one causal score pass against the same threshold).
//
// Below kParallelMin elements a kernel runs on one thread. These kernels are memory-bound (one thread moved
// a 28M-element AdamW update in 20 ms on the 2-core development machine), and on a shared, busy machine an
// OpenMP region can wait a scheduler time slice (~20 ms measured) for its second thread: with the earlier
// threshold of 32Ki elements, `kernels: custom` ran the quickstart at 0.92x of the reference ops, and the
// start-up timing of `kernels: auto` measured our SwiGLU at 18.9 ms against the reference's 0.8 ms for 512
// tokens x 344 (docs/benchmarks.md, "Kernel choice on the quickstart").
#ifndef BMT_CPU_PARALLEL_H_
#define BMT_CPU_PARALLEL_H_

#include <cstdint>

namespace bmt {

constexpr int64_t kParallelMin = int64_t(1) << 22;

}  // namespace bmt

#endif  // BMT_CPU_PARALLEL_H_
