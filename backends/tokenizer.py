"""The built-in tokenizer of session-backend: deterministic, no downloads, same ids in every process.

Vocabulary (ids are fixed by this file; changing the word list changes every id after it)::

    0              <pad>
    1              <s>     (bos; starts every prompt built here)
    2              </s>    (eos; the engine may end a sequence with it)
    3 .. 258       one token per byte value (so any UTF-8 text is representable)
    259 .. 259+W-1 " word" for each word of ``WORDS`` (leading space: generated text reads as words)
    259+W .. +2W-1 "word" (the same words without the space, for the start of a text)
    259+2W ..      chat role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|tool|>``,
                   ``<|developer|>``

Encoding splits text into chunks (`` ?[A-Za-z]+`` or any other single character); a chunk that is
a vocabulary word becomes that word's id, anything else becomes its UTF-8 bytes. So text -> ids ->
text round-trips exactly for any Unicode string, and re-encoding decoded word ids gives the same
ids back. Role markers are only produced by the chat template, never by encoding text.

The engine draws generated ids from ``[gen_token_min, gen_token_max)`` = the " word" range, so every
generated id decodes on its own to readable text (incremental detokenization is per token).

Chat template: ``<s>`` then, per message, ``<|role|>`` + ``"\\n"`` + content + ``"\\n"``, then
``<|assistant|>`` + ``"\\n"`` as the generation prompt. Each piece is encoded separately, so turn
N+1's ids begin with exactly turn N's prompt ids followed by turn N's answer ids (the answer's text
re-encodes to the generated ids): this is what lets the prefix cache hit on multi-turn chats.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_BASE = 3
WORD_BASE = BYTE_BASE + 256

# Common English words; the order fixes the ids. Append only.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to a in is it you that he was for on are with as I his they be at one have this from
    or had by hot word but what some we can out other were all there when up use your how said an each
    she which do their time if will way about many then them write would like so these her long make
    thing see him two has look more day could go come did number sound no most people my over know
    water than call first who may down side been now find any new work part take get place made live
    where after back little only round man year came show every good me give our under name very through
    just form sentence great think say help low line differ turn cause much mean before move right boy
    old too same tell does set three want air well also play small end put home read hand port large
    spell add even land here must big high such follow act why ask men change went light kind off need
    house picture try us again animal point mother world near build self earth father head stand own
    page should country found answer school grow study still learn plant cover food sun four between
    state keep eye never last let thought city tree cross farm hard start might story saw far sea draw
    left late run while press close night real life few north open seem together next white children
    begin got walk example ease paper group always music those both mark often letter until mile river
    car feet care second book carry took science eat room friend began idea fish mountain stop once base
    hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red
    list though feel talk bird soon body dog family direct pose leave song measure door product black
    short numeral class wind question happen complete ship area half rock order fire south problem piece
    told knew pass since top whole king space heard best hour better true during hundred five remember
    step early hold west ground interest reach fast verb sing listen six table travel less morning ten
    simple several vowel toward war lay against pattern slow center love person money serve appear road
    map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
    machine note wait plan figure star box noun field rest correct able pound done beauty drive stood
    contain front teach week final gave green oh quick develop ocean warm free minute strong special mind
    behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
    decide surface deep moon island foot system busy test record boat common gold possible plane stead
    dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes
    distant fill east paint language among grand ball yet wave drop heart am present heavy dance engine
    position arm wide sail material size vary settle speak weight general ice matter circle pair include
    divide syllable felt perhaps pick sudden count square reason length represent art subject region
    energy hunt probable bed brother egg ride cell believe fraction forest sit race window store summer
    train sleep prove lone exercise wall catch mount wish sky board joy winter sat written wild
    instrument kept glass grass cow job edge sign visit past soft fun bright gas weather month million
    bear finish happy hope flower clothe strange gone jump baby eight village meet root buy raise solve
    metal whether push seven paragraph third shall held hair describe cook floor either result burn hill
    safe cat century consider type law bit coast copy phrase silent tall sand soil roll temperature
    finger industry value fight lie beat excite natural view sense ear else quite broke case middle kill
    son lake moment scale loud spring observe child straight consonant nation dictionary milk speed
    method organ pay age section dress cloud surprise quiet stone tiny climb cool design poor lot
    experiment bottom key iron single stick flat twenty skin smile crease hole trade melody trip office
    receive row mouth exact symbol die least trouble shout except wrote seed tone join suggest clean
    break lady yard rise bad blow oil blood touch grew cent mix team wire cost lost brown wear garden
    equal sent choose fell fit flow fair bank collect save control decimal gentle woman captain practice
    separate difficult doctor please protect noon whose locate ring character insect caught period
    indicate radio spoke atom human history effect electric expect crop modern element hit student corner
    party supply bone rail imagine provide agree thus capital chair danger fruit rich thick soldier
    process operate guess necessary sharp wing create neighbor wash bat rather crowd corn compare poem
    string bell depend meat rub tube famous dollar stream fear sight thin triangle planet hurry chief
    colony clock mine tie enter major fresh search send yellow gun allow print dead spot desert suit
    current lift rose continue block chart hat sell success company subtract event particular deal swim
    term opposite wife shoe shoulder spread arrange camp invent cotton born determine quart nine truck
    noise level chance gather shop stretch throw shine property column molecule select wrong gray repeat
    require broad prepare salt nose plural anger claim continent oxygen sugar death pretty skill women
    season solution magnet silver thank branch match suffix especially fig afraid huge sister steel
    discuss forward similar guide experience score apple bought led pitch coat mass card band rope slip
    win dream evening condition feed tool total basic smell valley nor double seat arrive master track
    parent shore division sheet substance favor connect post spend chord fat glad original share station
    dad bread charge proper bar offer segment slave duck instant market degree populate chick dear enemy
    reply drink occur support speech nature range steam motion path liquid log meant quotient teeth
    shell neck
    """.split()
)

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")

_CHUNK = re.compile(r" ?[A-Za-z]+|.", re.DOTALL)
_CHUNK_CACHE_SIZE = 65536


class Tokenizer:
    """Byte-level tokenizer with a fixed English word list and a chat template."""

    def __init__(self) -> None:
        n = len(WORDS)
        self.spaced_base = WORD_BASE
        self.bare_base = WORD_BASE + n
        self.role_base = WORD_BASE + 2 * n
        self.vocab_size = self.role_base + len(ROLES)
        #: generated ids come from this half-open range; each decodes to " word"
        self.gen_token_min = self.spaced_base
        self.gen_token_max = self.spaced_base + n
        self.bos_token_id = BOS_ID
        self.eos_token_id = EOS_ID
        pieces: list[bytes] = [b"", b"", b""]  # pad, bos, eos decode to nothing
        pieces += [bytes((b,)) for b in range(256)]
        pieces += [(" " + w).encode() for w in WORDS]
        pieces += [w.encode() for w in WORDS]
        pieces += [f"<|{r}|>".encode() for r in ROLES]
        self._pieces = pieces
        self._strs: list[str] = [p.decode("utf-8", errors="replace") for p in pieces]
        self._strs[PAD_ID], self._strs[BOS_ID], self._strs[EOS_ID] = "<pad>", "<s>", "</s>"
        self._word_ids: dict[str, int] = {}
        for i, w in enumerate(WORDS):
            self._word_ids.setdefault(" " + w, self.spaced_base + i)
            self._word_ids.setdefault(w, self.bare_base + i)
        self._role_ids = {r: self.role_base + i for i, r in enumerate(ROLES)}
        self._newline = [BYTE_BASE + 0x0A]
        # byte ids of the non-word chunks seen so far (bounded; a pure cache)
        self._chunk_ids: dict[str, list[int]] = {}

    # ---- text <-> ids -------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids: list[int] = [BOS_ID] if add_bos else []
        word_ids = self._word_ids
        chunk_ids = self._chunk_ids
        for chunk in _CHUNK.findall(text):
            wid = word_ids.get(chunk)
            if wid is not None:
                ids.append(wid)
                continue
            cached = chunk_ids.get(chunk)
            if cached is None:
                # an unknown word (with its leading space) or any other character: its UTF-8 bytes
                cached = [BYTE_BASE + b for b in chunk.encode("utf-8", errors="surrogatepass")]
                if len(chunk) <= 32 and len(chunk_ids) < _CHUNK_CACHE_SIZE:
                    chunk_ids[chunk] = cached
            ids += cached
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; pad/bos/eos are dropped unless ``skip_special_tokens`` is False.

        Raises ``ValueError`` for an id outside the vocabulary.
        """
        pieces = self._pieces
        size = self.vocab_size
        out = bytearray()
        for i in ids:
            if not 0 <= i < size:
                raise ValueError(f"token id {i} is out of vocabulary (size {size})")
            if i <= EOS_ID and not skip_special_tokens:
                out += self._strs[i].encode()
            else:
                out += pieces[i]
        return out.decode("utf-8", errors="replace")

    def token_str(self, token_id: int) -> str:
        return self._strs[token_id]

    def out_of_vocab(self, ids: Sequence[int]) -> int | None:
        """The first id that is negative or not in the vocabulary, else None."""
        size = self.vocab_size
        for i in ids:
            if not 0 <= i < size:
                return i
        return None

    # ---- chat template -----------------------------------------------------------------
    def role_id(self, role: str) -> int | None:
        return self._role_ids.get(role)

    def apply_chat_template(
        self, messages: Iterable[tuple[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``(role, text)`` messages rendered with the built-in template.

        Raises ``ValueError`` for a role outside ``ROLES``.
        """
        ids = [BOS_ID]
        nl = self._newline
        for role, text in messages:
            rid = self._role_ids.get(role)
            if rid is None:
                raise ValueError(f"unknown message role {role!r}; expected one of {', '.join(ROLES)}")
            ids.append(rid)
            ids += nl
            ids += self.encode(text)
            ids += nl
        if add_generation_prompt:
            ids.append(self._role_ids["assistant"])
            ids += nl
        return ids
