#include "ckpt/sha256.h"

#include <openssl/evp.h>

#include <memory>

#include "core/check.h"

namespace moecore::ckpt {

struct Sha256::Ctx {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> md{EVP_MD_CTX_new(), EVP_MD_CTX_free};
  void init() {
    MOE_CHECK(md != nullptr, "[ckpt] sha256: EVP_MD_CTX_new failed (out of memory)");
    MOE_CHECK(EVP_DigestInit_ex(md.get(), EVP_sha256(), nullptr) == 1,
              "[ckpt] sha256: EVP_DigestInit_ex failed");
  }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  ctx_->init();
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(std::span<const std::byte> data) {
  if (data.empty()) return;
  MOE_CHECK(EVP_DigestUpdate(ctx_->md.get(), data.data(), data.size()) == 1,
            "[ckpt] sha256: EVP_DigestUpdate failed on {} bytes", data.size());
}

std::string Sha256::finish() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  MOE_CHECK(EVP_DigestFinal_ex(ctx_->md.get(), md, &len) == 1 && len == 32,
            "[ckpt] sha256: EVP_DigestFinal_ex failed");
  ctx_->init();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(64, '0');
  for (unsigned i = 0; i < 32; ++i) {
    out[2 * i] = kHex[md[i] >> 4];
    out[2 * i + 1] = kHex[md[i] & 15];
  }
  return out;
}

std::string sha256_hex(std::span<const std::span<const std::byte>> pieces) {
  Sha256 h;
  for (const std::span<const std::byte> p : pieces) h.update(p);
  return h.finish();
}

std::string sha256_hex(std::span<const std::byte> data) {
  const std::span<const std::byte> pieces[] = {data};
  return sha256_hex(pieces);
}

std::string sha256_hex(std::string_view text) {
  return sha256_hex(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

bool is_sha256_hex(std::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace moecore::ckpt
