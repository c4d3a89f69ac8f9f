// One checkpoint save between the description of this rank's state and the tracker: the shards'
// contents (read from the values as they are written, or, for a background write, from one host
// copy of them), this rank's part of the manifest and the run state rank 0 records. The shards
// are written in the foreground, or in a background thread (--async-save: training goes on
// while the files are written and hashed); finish() then completes the protocol of
// docs/checkpoint_format.md (gather of the parts, manifest, publication, tracker) on the main
// thread, collectively, so no communication runs off the main thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>
#include <thread>

#include "ckpt/manifest.h"
#include "ckpt/safetensors_writer.h"
#include "parallel/communicator.h"

namespace moecore::train {

struct SaveInFlight {
  std::filesystem::path save;     // the --save directory
  std::filesystem::path staging;  // its iter_NNNNNNN.partial
  int64_t iteration = 0;
  int rank = 0;
  ckpt::SafetensorsWriter shards[2];  // model, optimizer
  std::string files[2];
  ckpt::Manifest part;  // this rank's tensors; write() adds its files
  ckpt::Manifest head;  // rank 0: the layout and the run state of the manifest

  SaveInFlight() = default;
  SaveInFlight(const SaveInFlight&) = delete;
  SaveInFlight& operator=(const SaveInFlight&) = delete;
  ~SaveInFlight();  // waits for a background write (an unfinished save stays a staging dir)

  // Writes the non-empty shards into the staging directory and records them in `part`.
  void write();
  // write() in a background thread; written() says whether it has returned.
  void start_background();
  bool written() const { return !background_.joinable() || done_.load(); }
  // Completes the save: waits for the shards (writes them first when no background write was
  // started), then with every rank of `world` (null: one rank) gathers the parts, and rank 0 writes
  // the manifest, publishes the directory and writes the tracker. A failure on any rank (the
  // background write's included) throws on every rank.
  void finish(parallel::Communicator* world);

 private:
  std::thread background_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  bool written_ = false;  // write() has run (or is running in the background)
};

}  // namespace moecore::train
