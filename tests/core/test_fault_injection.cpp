// MOECORE_FAULT's parser (core/fault_injection.h): what the robustness tests write is what the
// code sees, and a malformed value is refused rather than ignored.
#include "core/fault_injection.h"

#include <gtest/gtest.h>

#include "core/check.h"

namespace moecore::fault {
namespace {

TEST(FaultInjection, ParsesKindsAndArguments) {
  const std::vector<Fault> f = parse("nan_loss:rank=1:iter=3;kill:at=publish.after_rename");
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].kind, "nan_loss");
  EXPECT_EQ(f[0].int_arg("rank", -1), 1);
  EXPECT_EQ(f[0].int_arg("iter", -1), 3);
  EXPECT_EQ(f[0].int_arg("param", 7), 7);
  EXPECT_TRUE(f[0].matches(1, 3));
  EXPECT_FALSE(f[0].matches(0, 3));
  EXPECT_FALSE(f[0].matches(1, 4));
  EXPECT_FALSE(f[0].matches(-1, 3)) << "an unknown rank matches only an absent rank key";
  EXPECT_EQ(f[1].kind, "kill");
  EXPECT_EQ(f[1].arg("at"), "publish.after_rename");
  EXPECT_TRUE(f[1].matches(5, 9)) << "no rank or iter: every rank and iteration";
  EXPECT_TRUE(parse("").empty());
}

TEST(FaultInjection, MalformedValuesAreRefused) {
  for (const char* bad : {"nan_loss:rank", "nan_loss:rank=x", ":rank=1", "a;;b", "a:=1"}) {
    EXPECT_THROW(parse(bad), Error) << bad;
  }
}

}  // namespace
}  // namespace moecore::fault
