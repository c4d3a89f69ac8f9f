// The sync audit as the sanitizer build of the grid emulator's tests has it: never armed.
// src/core/sync_audit.cpp replaces the global operator new (its allocation audit), which under
// AddressSanitizer would take the allocation functions from ASan's and lose its new/delete
// mismatch checks. No emulator test audits a step, so the kernels' host syncs (the read-backs of
// permute.cu) record nothing here, exactly as the real audit does outside an audited step.
// Linked by scripts/emu_sanitizers.sh only (CMake's test_emu links the real one).
#include "core/sync_audit.h"

namespace moecore {

SyncAudit& SyncAudit::instance() {
  static SyncAudit audit;
  return audit;
}

void SyncAudit::host_sync(const char*, const char*) {}
SyncAudit::Point::Point(const char*) : outer_(nullptr) {}
SyncAudit::Point::~Point() = default;
SyncAudit::Paused::Paused() : was_armed_(false) {}
SyncAudit::Paused::~Paused() = default;
// The capture rules: no test of this build captures (test_emu_capture.cpp, which checks them,
// links the real audit in CMake's test_emu only).
void SyncAudit::begin_capture(const std::string&) {}
void SyncAudit::end_capture() {}
void SyncAudit::device_allocation(const char*, std::size_t) {}
void SyncAudit::not_capturable(const char*) {}

}  // namespace moecore
