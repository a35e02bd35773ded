#!/usr/bin/env python3
"""Writes corpus.jsonl: one JSON string per line, the texts the tokenizer conformance test
encodes. Deterministic (fixed PRNG seed): running it again gives the same file, byte for byte
the file that its JavaScript original (gen_corpus.js, before the move off npm) wrote.

    .venv/bin/python replica/text/tests/conformance/gen_corpus.py [--out FILE]

Texts are JSON strings so that they can hold newlines, carriage returns, tabs and any code
point. The corpus covers: many languages and scripts, code with indentation and tabs,
emoji (ZWJ sequences, skin tones, flags, keycaps), runs of spaces and newlines, every
Unicode white space character, digits and long numbers in several scripts, NFC vs NFD
forms, special tokens of the three vocabularies written in the text, characters whose
Unicode properties changed between versions, and random code points from many blocks.
"""
import argparse
import json
import pathlib
import unicodedata

lines = []


def add(*xs):
    lines.extend(xs)


# ---- natural languages ----
add(
  'Hello world',
  'Hello, world! How are you doing today?',
  "I'm sure you'll see they've said we'd go; it's John's, isn't it?",
  "DON'T SHOUT. I'M HERE. WE'LL SEE. YOU'RE RIGHT. THEY'VE GONE. HE'D KNOW. IT'S MINE.",
  "Mixed case contractions: I'Ll, You'Re, It'S, We'Ve, He'D, I'M.",
  'The quick brown fox jumps over the lazy dog. 1234567890',
  '“Smart quotes” and ‘single ones’ — with an em dash – and an en dash… and ellipsis.',
  'E-mail me at jane.doe+tokens@example.com or visit https://example.org/path?q=1&lang=en#top',
  'Markdown: **bold**, _italic_, `code`, [link](http://x.y), > quote\n- item one\n- item two',
  'A sentence with trailing spaces   ',
  '   A sentence with leading spaces',
  'Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis',
  'Der schnelle braune Fuchs springt über den faulen Hund. Äpfel, Öl, Übermut, Straße, Maß.',
  'Donaudampfschifffahrtsgesellschaftskapitänswitwe und Rindfleischetikettierungsüberwachungsaufgabenübertragungsgesetz',
  'Grüß Gott! Wie geht’s? „Anführungszeichen“ und »Guillemets«.',
  "Le cœur a ses raisons que la raison ne connaît point. L'été à Noël, où êtes-vous ?",
  "Ça va ? « Oui, très bien ! » Qu'est-ce que c'est ? Aujourd’hui, l’œuvre d’Éric.",
  'El niño comió jalapeños en el año 2023. ¿Dónde está la biblioteca? ¡Olé!',
  'A língua portuguesa: ação, coração, pão, avó, você, João.',
  "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, ché la diritta via era smarrita.",
  'Zażółć gęślą jaźń. Pchnąć w tę łódź jeża lub ośm skrzyń fig.',
  'Příliš žluťoučký kůň úpěl ďábelské ódy.',
  'İstanbul’da ılık bir gün; IĞDIR, ışık, İzmir, şeker, çiçek.',
  'Tiếng Việt có dấu: Tôi yêu tiếng nước tôi từ khi mới ra đời.',
  'Съешь же ещё этих мягких французских булок, да выпей чаю.',
  'Привет, мир! Как дела? Всё хорошо, спасибо. Ёжик в тумане.',
  'Україна, Київ, ґанок, їжак, є, і.',
  'Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Καλημέρα κόσμε! ΟΔΥΣΣΕΥΣ, Σίσυφος, σοφός.',
  'Τὴ γλῶσσα μοῦ ἔδωσαν ἑλληνική· τὸ σπίτι φτωχικὸ στὶς ἀμμουδιὲς τοῦ Ὁμήρου.',
  '我能吞下玻璃而不伤身体。你好，世界！今天天气很好。',
  '中华人民共和国成立于1949年10月1日。人工智能（AI）正在改变世界。',
  '繁體中文：臺灣、香港、電腦、語言模型。',
  '日本語のテキスト：私はガラスを食べられます。それは私を傷つけません。',
  'ひらがな、カタカナ、漢字が混在する文章です。東京都渋谷区１２３番地',
  '半角ｶﾀｶﾅとＦｕｌｌｗｉｄｔｈ　ＡＳＣＩＩ、そして「かぎかっこ」。',
  '한국어 텍스트: 나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.',
  '안녕하세요, 세계! 대한민국 서울특별시 123번지.',
  'العربية: أستطيع أكل الزجاج و هذا لا يؤلمني. مرحبا بالعالم!',
  'الْعَرَبِيَّةُ مع التشكيل: بِسْمِ اللَّهِ الرَّحْمَٰنِ الرَّحِيمِ',
  'עברית: אני יכול לאכול זכוכית וזה לא מזיק לי. שָׁלוֹם עוֹלָם',
  'हिन्दी: मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती। नमस्ते दुनिया!',
  'संस्कृतम्: क्षत्रिय, ज्ञान, श्री, द्वार, त्र्यम्बकं',
  'বাংলা: আমি কাঁচ খেতে পারি, তাতে আমার কোনো ক্ষতি হয় না।',
  'தமிழ்: நான் கண்ணாடி சாப்பிடுவேன், அதனால் எனக்கு ஒரு கேடும் வராது.',
  'ภาษาไทย: ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ สวัสดีชาวโลก',
  'ພາສາລາວ ແລະ ភាសាខ្មែរ ແລະ မြန်မာဘာသာ',
  'Հայերեն: Կրնամ ապակի ուտել և ինծի անհանգիստ չըներ։ ქართული: მინას ვჭამ და არა მტკივა.',
  'አማርኛ: ብርጭቆ መብላት እችላለሁ፣ አይጎዳኝም። ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ',
  'Kiswahili: Naweza kula bilauri na sikunyui. Yorùbá: Mo lè jẹ́ dígí, kò ní pa mí lára.',
  'Íslenska: Ég get etið gler án þess að meiða mig. Føroyskt: Eg kann eta glas.',
  'Mixed: Hello 世界 مرحبا שלום Привет γειά こんにちは 안녕 नमस्ते สวัสดี',
  'Right-to-left with marks: \u200Fمرحبا\u200E hello \u202Bעברית\u202C end',
  'Math: ∀x∈ℝ, ∃y: x² + y² = z²; ∑ᵢ aᵢ ≤ ∞; ∫₀¹ f(x) dx ≈ π/4; α→β ⇒ γ ≠ δ ± ε',
  'Currency: $100, €200, £300, ¥400, ₹500, ₩600, ₿0.001, 5¢',
  'Old scripts and rare planes: 𐌰𐌱𐌲 𒀀𒀁 𓀀𓀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕿𝖊𝖝𝖙 𝟙𝟚𝟛',
  'Box drawing ┌─┬─┐ │ │ │ └─┴─┘ and blocks ▁▂▃▄▅▆▇█ and braille ⠓⠑⠇⠇⠕',
)

# ---- emoji ----
add(
  'Emoji: 😀😃😄😁😆😅😂🤣🥲☺️😊',
  'Thumbs up with skin tones: 👍 👍🏻 👍🏼 👍🏽 👍🏾 👍🏿',
  'Family ZWJ: 👨‍👩‍👧‍👦 👩‍👩‍👦 👨‍👨‍👧‍👧 and professions 🧑🏿‍💻 👩🏽‍🚀 👨🏻‍🍳',
  'Flags: 🇩🇪 🇫🇷 🇯🇵 🇺🇸 🇧🇷 🏳️‍🌈 🏴‍☠️ 🏴󠁧󠁢󠁳󠁣󠁴󠁿',
  'Keycaps and variation selectors: 1️⃣ 2️⃣ #️⃣ *️⃣ ❤️ ❤︎ ☀️ ✔️ ™️ ©️',
  'Hearts❤️‍🔥❤️‍🩹 and 🫠🫡🫶🏽🪿 new emoji',
  'emoji🙂glued🙂to🙂words and 🙂 spaced 🙂',
  '🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥🔥',
  'Kaomoji: (╯°□°）╯︵ ┻━┻  ¯\\_(ツ)_/¯  ( ͡° ͜ʖ ͡°)',
)

# ---- source code ----
add(
  'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n',
  'class Foo:\n\tdef __init__(self):\n\t\tself.x = {"a": [1, 2, 3]}\n\n\tdef bar(self, *args, **kwargs):\n\t\treturn None\n',
  '#include <iostream>\n#include <vector>\n\nint main(int argc, char** argv) {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) std::cout << x << "\\n";\n  return 0;\n}\n',
  'template <typename T>\nconstexpr T max(const T& a, const T& b) noexcept { return a < b ? b : a; }',
  'const add = (a, b) => a + b;\nconsole.log(`sum: ${add(2, 3)}`);\nexport default { add };',
  'async function fetchData(url) {\n  try {\n    const res = await fetch(url);\n    return await res.json();\n  } catch (e) {\n    console.error(e);\n  }\n}',
  'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}',
  'package main\n\nimport "fmt"\n\nfunc main() {\n\tfmt.Println("hello, 世界")\n}\n',
  'SELECT u.id, COUNT(*) AS n FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total > 100.50 GROUP BY u.id ORDER BY n DESC;',
  '<!DOCTYPE html>\n<html lang="en">\n  <head><meta charset="utf-8"><title>Test</title></head>\n  <body><p class="x">Hi &amp; bye</p></body>\n</html>',
  '{"name": "replica", "version": "0.1.0", "tags": ["a", "b"], "nested": {"k": null, "n": -1.5e10}}',
  'key: value\nlist:\n  - one\n  - two\nnested:\n    deeper: true\n',
  '#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  echo "$f" | tr a-z A-Z >> out.log 2>&1\ndone',
  'all: build\n\nbuild:\n\t$(CC) -O2 -o app main.c\n\nclean:\n\trm -f app *.o\n',
  'public static void main(String[] args) {\n        System.out.println("Hello");\n    }',
  '    \t    mixed\t \tindentation\t\t\n\t\t    here',
  'x=1;y=2;z=x+y*3-4/5%6**7//8',
  'if (a && b || !c) { x += 1; } else if (d != e) { y <<= 2; z >>>= 3; }',
  'regex = r"(?i:\'s|\'t|\'re)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"',
  '// comment\n/* block\n   comment */\n# hash comment\n-- sql comment\n<!-- html comment -->',
  '\\documentclass{article}\n\\begin{document}\n$E = mc^2$ and \\(\\frac{a}{b}\\)\n\\end{document}',
  'diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n-old line\n+new line\n context',
)

# ---- white space ----
for n in range(1, 17):
    add(' ' * n, 'a' + ' ' * n + 'b')
add(' ' * 33 + 'x', 'x' + ' ' * 100, ' ' * 257)
for n in range(1, 9):
    add('\n' * n, 'line' + '\n' * n + 'next')
add(
  '\t', '\t\t\t', 'a\tb\t\tc\t\t\td', '\r\n', 'a\r\nb\r\n\r\nc', 'a\rb', '\r\r\n\n',
  ' \n ', '  \n  \n  ', 'x \n y', 'x\n \ny', 'end with newline\n', '\nstart with newline',
  'spaces before newline   \nand after\n   indented', '\n\n\n   \n\n\t\n',
  'a\u000Bb\u000Cc', 'a\u001Cb\u001Dc\u001Ed\u001Ff',
)
# Every Unicode White_Space character, and some look-alikes that are not.
spaces = [
  '\u0085', '\u00A0', '\u1680', '\u2000', '\u2001', '\u2002', '\u2003', '\u2004', '\u2005',
  '\u2006', '\u2007', '\u2008', '\u2009', '\u200A', '\u2028', '\u2029', '\u202F', '\u205F',
  '\u3000', '\u180E', '\u200B', '\u200C', '\u200D', '\u2060', '\uFEFF',
]
for s in spaces:
    add(f'a{s}b', f'word{s}{s}word', f'{s}lead', f'trail{s}', f'x {s} y', f'1{s}2', f'.{s}\n')
add(''.join(spaces), ' '.join(spaces), 'Non\u00A0breaking\u00A0spaces\u00A0everywhere', 'Ideographic\u3000space\u3000here')

# ---- digits and numbers ----
add(
  '0', '12', '123', '1234', '12345', '123456', '1234567', '12345678901234567890',
  '3.14159265358979323846264338327950288419716939937510',
  '1,000,000 and 1.000.000 and 1 000 000 and 1\u202F000\u202F000',
  'Phone: +1 (555) 123-4567, ext. 89; ISBN 978-3-16-148410-0',
  'Dates: 2024-02-29T23:59:59Z, 29/02/2024, 02.29.24, 12:30:45.123',
  'Version v1.2.3-rc.4+build.567, IPv4 192.168.0.1, IPv6 fe80::1ff:fe23:4567:890a',
  'UUID 123e4567-e89b-12d3-a456-426614174000 and hex 0xDEADBEEF 0x7fffffff',
  'Fullwidth ０１２３４５６７８９ and Arabic-Indic ٠١٢٣٤٥٦٧٨٩ and Devanagari ०१२३४५६७८९',
  'Thai digits ๐๑๒๓ and Bengali ০১২৩ and Chinese 一二三 and Roman Ⅰ Ⅱ Ⅻ ⅿ',
  'Superscripts x² y³ and subscripts H₂O and fractions ½ ¼ ¾ ⅞ and circled ① ② ⑳',
  '2^64 = 18446744073709551616; 10! = 3628800; 1e-9; -0.0; +42; 007',
  'a1b22c333d4444e55555', '1a22b333c4444d', '9' * 50,
)

# ---- NFC vs NFD ----
nf = [
  'café', 'naïve', 'Åström', 'São Paulo', 'Ñandú', 'résumé', 'Crème brûlée', 'Zürich',
  'Ελληνικά', 'Việt Nam', '한국어', 'がぎぐげご パピプペポ', 'Ǆemal', 'ﬁnance ﬂower', 'Ω Å K',
]
for s in nf:
    add(*(unicodedata.normalize(form, s) for form in ('NFC', 'NFD', 'NFKC', 'NFKD')))
add(
  'e\u0301 vs \u00E9', 'A\u030A vs \u00C5 vs \u212B', '\u2126 ohm vs \u03A9 omega', 'K\u0301\u0302\u0303\u0304 stacked',
  'a\u0300\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308 zalgo-ish \u0334\u0335\u0336',
  '\u1100\u1161\u11A8 jamo vs \uAC01 syllable', 'ſ and \u017F and K\u212A', "it'\u017F and IT'\u212A",
)

# ---- special tokens written in text ----
add(
  '<|begin_of_text|>Hello', '<|begin_of_text|><|begin_of_text|>', 'text<|end_of_text|>',
  '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
  '<|reserved_special_token_0|> and <|reserved_special_token_250|> and <|reserved_special_token_251|>',
  '<s>[INST] What is 2+2? [/INST] 4</s>', '<s> <s>  <s>', '<s><s></s></s>', 'a<s>b</s>c<unk>d',
  ' <s>', '<s> ', 'x </s> y', '<<s>>', '<s', 's>', '</s', '<unk>', '< s >',
  '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n',
  '<|im_start|><|im_end|><|endoftext|>', '<|im_start', 'im_start|>', '<||>', '<|>', '<|im_start|>\n\n<|im_end|>',
  '<think>\nreasoning here\n</think>\n\nanswer', '<tool_call>{"name": "f"}</tool_call>',
  '<|vision_start|><|image_pad|><|vision_end|>', '<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>',
  'Mixing: <|begin_of_text|><s><|im_start|> all three', '   <|eot_id|>   ', '\n<|im_end|>\n',
)

# ---- miscellaneous edge cases ----
add(
  '', ' ', 'a', '.', '!', '?!', '...', '…', '—', '-', '_', '__init__', '@', '#', '$', '%', '^', '&', '*',
  '!!!!!!!!!!!!', '????', '........', '--------', '========', '________', '~~~~', '```python\nprint(1)\n```',
  'a' * 300, 'ab' * 200, 'Lorem' * 60,
  'aGVsbG8gd29ybGQgdGhpcyBpcyBhIGJhc2U2NCBibG9iIG9mIHRleHQ=' + 'QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=' * 5,
  "'s 't 're 've 'm 'll 'd", "'S'T'RE'VE'M'LL'D", "''''", "'", "a'b", "rock'n'roll", "'hello'",
  'ALL CAPS SENTENCE WITH NUMBERS 123 AND PUNCTUATION!!!', 'camelCaseIdentifier snake_case_name kebab-case-name',
  'path/to/some/file.txt C:\\Windows\\System32 ~/.bashrc ../up/../and/./here',
  'tab\tseparated\tvalues\n1\t2\t3', 'comma,separated,values\n"quoted, field",2,3',
  'Replacement char \uFFFD and private use \uE000\uF8FF and noncharacter \uFDD0',
  'Control chars: \u0001\u0002\u0007\u001B[31mred\u001B[0m\u007F',
  'Soft\u00ADhyphen and zero\u200Bwidth and word\u2060joiner',
)

# ---- long text and mixes ----
add(
  ' '.join(lines[0:30]),
  '\n'.join(lines[30:60]),
  'Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore magna aliqua. ' * 8,
)

# ---- random strings from a pool of tricky pieces (fixed seed) ----
# xorshift32, as the JavaScript original computed it with 32-bit integers.
seed = 0x5EED1234


def rand(n):
    global seed
    seed = (seed ^ (seed << 13)) & 0xFFFFFFFF
    seed ^= seed >> 17
    seed = (seed ^ (seed << 5)) & 0xFFFFFFFF
    return seed % n


POOL = [
  ' ', ' ', ' ', '  ', '\n', '\n\n', '\t', '\r\n', '\u00A0', '\u3000', '\u0085', '\u2028', '\u200B', '\uFEFF',
  'a', 'the', 'The', 'hello', 'Hello', 'WORLD', 'don', "'", "'s", "'LL", '"', '.', ',', '!', '?', ':', ';', '-', '_',
  '(', ')', '[', ']', '{', '}', '<', '>', '|', '/', '\\', '#', '@', '$', '%', '&', '*', '+', '=', '~', '`', '^',
  '0', '1', '42', '123', '2024', '3.14', '１２', '٣', '²', '½', 'Ⅻ',
  'é', 'e\u0301', 'ß', 'ñ', 'Å', 'Ω', 'ſ', 'K', 'İ', 'ı', 'ﬁ',
  '日本', '中文', '한국', 'Привет', 'γειά', 'مرحبا', 'שלום', 'नमस्ते', 'สวัสดี',
  '😀', '👍🏽', '👨‍👩‍👧', '🇩🇪', '1️⃣', '❤️', '𝔘', '𒀀',
  '<s>', '</s>', '<unk>', '<|begin_of_text|>', '<|eot_id|>', '<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>',
  '<|', '|>', '<', 's>', 'def ', 'return ', '    ', '\t\t', '=>', '::', '->', '!=', '==',
]
for _ in range(240):
    n = 1 + rand(24)
    add(''.join(POOL[rand(len(POOL))] for _ in range(n)))

# ---- characters whose properties differ between Unicode versions ----
# The Rust engine normalizes with Unicode 11.0 tables and strips accents with Unicode 9.0
# marks, while Rust's own char properties (Digits, \w, lowercase) are Unicode 16+.
add(
  '\u0384\U00010EFE\u0367 reordering across a Unicode 15 mark',
  'Garay digits \U00010D40\U00010D41\U00010D42 and letters \U00010D50\U00010D61 and Kawi \U00011F50\U00011F51',
  '\U000107A0\'LL\'s and \U0001E030 (NFKD: no decomposition in Unicode 11)',
  'Sogdian \U00010F46\U00010F47 Vedic \u1CF2\u1CF3\u1CF7 and \U000111C9',
  'Latin \uA7CB\uA7CC\uA7DA\uA7DC and Cyrillic \u1C89 and Arabic \u0897',
  'Segmented \U0001FBF0\U0001FBF1 outlined \U0001CCF0\U0001CCF1 Ol Onal \U0001E5F1',
)

# ---- random code points from many blocks (fixed seed) ----
BLOCKS = [
  (0x20, 0x7e), (0x20, 0x7e), (0x20, 0x7e), (0x0, 0x20), (0x80, 0xff), (0x100, 0x24f), (0x300, 0x36f),
  (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5ff), (0x600, 0x6ff), (0x900, 0x97f), (0xe00, 0xe7f),
  (0x1100, 0x11ff), (0x1680, 0x1680), (0x180e, 0x180e), (0x1cd0, 0x1cff), (0x2000, 0x206f), (0x2070, 0x218f),
  (0x2190, 0x2bff), (0x3000, 0x303f), (0x3040, 0x30ff), (0x4e00, 0x4fff), (0xa700, 0xa7ff), (0xac00, 0xad00),
  (0xfb00, 0xfb4f), (0xfe00, 0xfe0f), (0xfeff, 0xfeff), (0xff00, 0xffef), (0xfff0, 0xfffd), (0x10d00, 0x10fff),
  (0x11000, 0x11fff), (0x1d400, 0x1d7ff), (0x1f300, 0x1faff), (0x1f3fb, 0x1f3ff), (0xe0000, 0xe007f),
  (0x10000, 0x10cff), (0x16000, 0x16fff), (0x1e000, 0x1efff), (0x20000, 0x20fff),
]
for _ in range(200):
    n = 1 + rand(30)
    s = ''
    for _ in range(n):
        if rand(6) == 0:
            s += POOL[rand(len(POOL))]
            continue
        a, b = BLOCKS[rand(len(BLOCKS))]
        cp = a + rand(b - a + 1)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0x41
        s += chr(cp)
    add(s)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--out', type=pathlib.Path, default=pathlib.Path(__file__).with_name('corpus.jsonl'))
    args = parser.parse_args()
    # json.dumps(ensure_ascii=False) escapes exactly what JavaScript's JSON.stringify does.
    text = '\n'.join(json.dumps(s, ensure_ascii=False) for s in lines) + '\n'
    args.out.write_bytes(text.encode('utf-8'))
    print(f'wrote {len(lines)} texts to {args.out}')


if __name__ == '__main__':
    main()
