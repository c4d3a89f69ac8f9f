// The pre-tokenizer regexes of byte-level BPE tokenizers, as hand-written scanners over code
// points (std::regex has no \p{L}): each splits text into the pieces the regex's successive
// leftmost matches give, which BPE then encodes one by one.
//   Gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   Llama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//           ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen2:  the Llama-3 pattern with \p{N} (one digit a piece) for \p{N}{1,3}
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace moecore::data {

enum class PreTokenizerPattern { Gpt2, Llama3, Qwen2 };

// The pattern a tokenizer.json Split pre-tokenizer's regex string names; throws naming the
// pattern when it is none of the three.
PreTokenizerPattern pretokenizer_pattern_from_regex(const std::string& regex);
const char* pretokenizer_pattern_regex(PreTokenizerPattern p);

// Appends the pieces of `text` (views into it, in order, covering it exactly) to `out`.
void pretokenize(PreTokenizerPattern p, std::string_view text, std::vector<std::string_view>& out);

}  // namespace moecore::data
