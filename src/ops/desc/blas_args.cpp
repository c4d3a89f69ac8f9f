// The argument plumbing of the cuBLASLt / cuBLAS calls (blas_args.h).
#include "ops/desc/blas_args.h"

#include <cstring>

#include "core/check.h"

namespace moecore::ops::desc {

size_t blas_type_bytes(BlasDataType t) {
  switch (t) {
    case BlasDataType::R32F:
      return 4;
    case BlasDataType::R64F:
      return 8;
    case BlasDataType::R16BF:
      return 2;
  }
  MOE_CHECK(false, "[blas] unknown data type {}", static_cast<int>(t));
  return 0;
}

BlasDataType blas_scale_type(BlasComputeType compute) {
  return compute == BlasComputeType::F64 ? BlasDataType::R64F : BlasDataType::R32F;
}

MatmulOperands matmul_operands(const LtMatmulDesc& d, const void* A, const void* B) {
  MatmulOperands o;
  o.a_slot = d.a_operand == GemmOperand::A ? A : B;
  o.b_slot = d.b_operand == GemmOperand::A ? A : B;
  return o;
}

BlasScalar blas_scalar(BlasDataType scale_type, double v) {
  BlasScalar s;
  switch (scale_type) {
    case BlasDataType::R32F: {
      const float f = static_cast<float>(v);
      std::memcpy(s.bytes, &f, sizeof f);
      return s;
    }
    case BlasDataType::R64F:
      std::memcpy(s.bytes, &v, sizeof v);
      return s;
    case BlasDataType::R16BF:
      break;
  }
  MOE_CHECK(false, "[blas] {} is not a scale type (R32F or R64F)", blas_data_type_name(scale_type));
  return s;
}

double blas_scalar_value(BlasDataType scale_type, const void* p) {
  if (scale_type == BlasDataType::R64F) {
    double v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  MOE_CHECK(scale_type == BlasDataType::R32F, "[blas] {} is not a scale type (R32F or R64F)",
            blas_data_type_name(scale_type));
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

GroupedArgs grouped_args(const GroupedBatchedDesc& d, const void* A, const void* B, void* C) {
  const size_t problems = d.a_off.size();
  MOE_CHECK(d.b_off.size() == problems && d.c_off.size() == problems,
            "[blas] grouped descriptor: {} A offsets, {} B offsets, {} C offsets", problems,
            d.b_off.size(), d.c_off.size());
  const void* a_base = d.a_operand == GemmOperand::A ? A : B;
  const void* b_base = d.b_operand == GemmOperand::A ? A : B;
  const size_t as = blas_type_bytes(d.a_type), bs = blas_type_bytes(d.b_type),
               cs = blas_type_bytes(d.c_type);
  GroupedArgs g;
  g.a.reserve(problems);
  g.b.reserve(problems);
  g.c.reserve(problems);
  for (size_t i = 0; i < problems; ++i) {
    g.a.push_back(static_cast<const char*>(a_base) + d.a_off[i] * static_cast<int64_t>(as));
    g.b.push_back(static_cast<const char*>(b_base) + d.b_off[i] * static_cast<int64_t>(bs));
    g.c.push_back(static_cast<char*>(C) + d.c_off[i] * static_cast<int64_t>(cs));
  }
  const BlasDataType scale = blas_scale_type(d.compute);
  const size_t ss = blas_type_bytes(scale);
  g.alpha.resize(static_cast<size_t>(d.group_count) * ss);
  g.beta.resize(g.alpha.size());
  for (int32_t i = 0; i < d.group_count; ++i) {
    std::memcpy(g.alpha.data() + i * ss, blas_scalar(scale, d.alpha[i]).bytes, ss);
    std::memcpy(g.beta.data() + i * ss, blas_scalar(scale, d.beta[i]).bytes, ss);
  }
  return g;
}

}  // namespace moecore::ops::desc
