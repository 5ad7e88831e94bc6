-- learnmesh context store: every operation of shared/context/store.py is one call of
-- lm_main (FCALL of this library, loaded once with FUNCTION LOAD; EVALSHA on Redis < 7; see
-- shared/context/scripts.py). It reads, writes, bumps the version, updates recency and enforces the
-- window, per-principal and idle bounds atomically, so no reader ever sees half a change.
--
-- KEYS (fixed list, built by shared.keys.ctx_keys; all in the principal's slot):
--   1 E  hash  "<cid>|<modality>|<seq>" -> stored entry (see stored_entry) (tag {principal})
--   2 M  hash  cid -> JSON meta; "\0v<cid>" -> "<version>;<epoch>;<mod>:<lo>:<hi>;..." of
--              cid (written with the meta: a window read needs nothing else, and checks
--              "unchanged" by comparing it, without decoding the meta; see ops.window);
--              "\0u<cid>" -> last use of cid (see R); and the principal's
--              state: "\0bytes", "\0clock" (highest last use), "\0exp" (last TTL refresh,
--              ms), "\0due" (no context can be idle before this ms: see expire_idle), on a
--              cluster "\0ch" (ms of the last change of "\0bytes": the evictor sets the
--              principal's global report right from "\0bytes" only once it is that old) — one
--              HMGET reads the state
--              together with the meta of the context the call is about  (tag {principal})
--   3 R  zset  cid -> last use: ms * 1000 (+1 per tie), strictly increasing per principal,
--              so it is both the exact LRU order and the last-use time. Kept lazily: a use
--              writes only "\0u<cid>" in M (in the HSET every call makes anyway), so a score
--              is a lower bound of the last use, exact once lru_head has looked at it
--              (tag {principal})
--   4 V  hash  "<cid>|<version>" -> "mod:lo:hi;..."              (tag {principal})
--   5 S  hash  cid -> last version of an evicted context           (tag {principal})
--   6 AU stream the principal's audit log (capped; shared/audit.py merges it with the others)
-- The global budget over all principals (shared/context/budget.py, docs/context.md) lives in
-- sharded accounting keys, and the gateway's evictor evicts least recently used principals
-- through evict_principal. On a cluster a script touches one slot: the store reports each
-- call's byte change (the `delta` of replies) and stamps the principal's use itself. On one
-- server the store passes the principal's shard of those keys, and the script keeps them:
--   7 GB hash  principal -> bytes it holds, "\0total" -> the shard's sum  (keys.ctx_global_bytes)
--   8 GL zset  principal -> ms of its last stamped use                   (keys.ctx_global_lru)
--   9 GS zset  principal -> ms it was evicted for the global budget     (keys.ctx_global_seen)
-- finish() adds the call's byte change to GB and stamps GL at most once per resolution (the
-- last stamp is kept in M, "\0gs"); evict_principal clears the principal's report, takes it
-- out of GL and into GS, in the same call.
-- ARGV: 1 op, 2 principal, 3 config "channel_max_entries:channel_max_bytes:
--       principal_budget_bytes:idle_ttl_ms:versions_retained:audit_maxlen:
--       global_lru_resolution_ms"
--       (one pre-encoded argument: fewer arguments to pack per call; with 1 and 2 it is packed
--       once per principal and operation by the client), 4 now_ms, 5.. op arguments.
-- Errors are error replies whose first word is the error kind (LM_NOTFOUND, ...).
--
-- Lean by design (every call costs a few µs per redis.call): the principal's state is read
-- with one HMGET, byte deltas are summed locally and written once at the end, reads never
-- rewrite the meta JSON (last use lives in the R score), and the keys' TTL is refreshed only
-- when the last refresh is older than idle_ttl/16 (the TTL set is idle_ttl + idle_ttl/16, so
-- keys always outlive idle_ttl after the last use). Window replies are runs of raw values.
-- Per-call state. The library is loaded once (FUNCTION LOAD) and these module locals are
-- reset at the start of every call by lm_main (Redis runs one call at a time).
local KEYV, ARGS
local E, M, R, V, S, AU
local GB, GL, GS                   -- the global accounting keys (one server only), else nil
local op, P, NOW_S, now
local CH_N, CH_B, P_BUD, IDLE, NVER, AMAX, SLACK, GRES
local CFG                          -- the configuration argument CH_N.. were parsed from
local BYTES, CLOCK, EXP, DUE = '\0bytes', '\0clock', '\0exp', '\0due'
local GSTAMP = '\0gs'                  -- M field: ms of the principal's last stamp in GL
local CHANGED = '\0ch'                 -- M field (cluster): ms of the last change of BYTES
local TOTAL = '\0total'                -- GB field: the shard's sum
local LU = '\0u'                       -- M field LU .. cid: last use of cid (R is lazy)
local VER = '\0v'                      -- M field VER .. cid: "<version>;<epoch>;<ranges>" (see save)
local K = 1000                         -- R score = last-use ms * K (+ tiebreak)

local evicted              -- {cid, reason} pairs evicted during this call
-- Principal state, read once per call (begin) and written once (finish).
local pbytes, pexp, pclock
local pstamp               -- ms of the principal's last stamp in GL (one server only)
local pdue, due_dirty      -- see expire_idle
local used                 -- cid -> last use given by this call, written by finish()
local pdelta               -- byte change not yet written to M
local cdelta               -- byte change of this call (replies carry it: see header)
local clock_dirty
local created              -- this call may have created a key that has no TTL yet

-- Exact decimal for scores/timestamps (redis.call would format numbers with %.17g). Every
-- value given is an integer below 2^53, and '%d' (a C long) formats it in a fraction of the
-- time '%.0f' takes (glibc prints doubles with multi-precision arithmetic): a warm read's
-- FCALL took 0.5-1 µs less.
local function num(x) return string.format('%d', x) end

local function audit(action, cid, ver, extra)
  local a = {'XADD', AU, 'MAXLEN', '~', AMAX, '*', 'ts_ms', NOW_S, 'principal', P, 'action', action}
  if cid then a[#a + 1] = 'context'; a[#a + 1] = cid end
  if ver then a[#a + 1] = 'version'; a[#a + 1] = tostring(ver) end
  if extra then for i = 1, #extra do a[#a + 1] = tostring(extra[i]) end end
  redis.call(unpack(a))
end

-- Sequence numbers (and versions) as decimal strings, each formatted once while the library
-- stays loaded.
-- Lua formats a number it concatenates with sprintf("%.14g"): building the 20 field names of
-- a first read's HMGET took ~4 µs of Redis CPU, ~1 µs with this table (docs/context.md,
-- "Where a read's time goes"). Bounded: numbers from 65536 up are formatted every time.
-- A string (a seq parsed from an argument) is already its decimal name.
local SEQS = {}
local function seqstr(s)
  local d = SEQS[s]
  if d then return d end
  if type(s) ~= 'number' then return s end
  d = string.format('%d', s)
  if s < 65536 then SEQS[s] = d end
  return d
end

local function efield(cid, mod, seq) return cid .. '|' .. mod .. '|' .. seqstr(seq) end

-- ------------------------------------------------------------------ stored entries
-- An entry is stored as a MessagePack array of the fields of shared.types.Entry, in order:
-- id, modality, role, content (bin), mime (nil or str), tokens, size_bytes, ts_ms, links
-- (array of "mod:seq"). The client sends everything after id and modality (the "body",
-- whose length is what budgets count: an entry's name is not counted, like its field
-- name); the script puts the name in front, as only it knows the sequence number. So a
-- run of a window's entries joined behind an array header is what the client decodes in
-- one C call (msgspec), straight into Entry objects (see shared/context/entries.py).
local function mp_str(s)  -- MessagePack str, in its shortest form (as msgspec writes it)
  local n = #s
  if n < 32 then return string.char(0xa0 + n) .. s end
  if n < 256 then return string.char(0xd9, n) .. s end
  return struct.pack('>BH', 0xda, n) .. s
end

local function mp_str_len(n)
  if n < 32 then return n + 1 elseif n < 256 then return n + 2 end
  return n + 3
end

local function digits(n)
  local d = 1
  while n >= 10 do n = n / 10; d = d + 1 end
  return d
end

-- Stored bytes of entry `seq` of channel `mod` that are its name (array header, id, modality).
local function name_len(mod, seq)
  return 1 + mp_str_len(#mod + 1 + digits(seq)) + mp_str_len(#mod)
end

local mod_strs = {}  -- modality -> its MessagePack str (the library stays loaded: built once)

local function stored_entry(mod, seq, body)
  local ms = mod_strs[mod]
  if not ms then ms = mp_str(mod); mod_strs[mod] = ms end
  local id = mod .. ':' .. seqstr(seq)
  if #id < 32 then return '\153' .. string.char(0xa0 + #id) .. id .. ms .. body end  -- one concatenation
  return '\153' .. mp_str(id) .. ms .. body
end

-- Position after the str / bin / nil element at `p`.
local function mp_skip(v, p)
  local b = string.byte(v, p)
  if b >= 0xa0 and b <= 0xbf then return p + 1 + b - 0xa0 end
  if b == 0xc0 then return p + 1 end
  if b == 0xd9 or b == 0xc4 then return p + 2 + string.byte(v, p + 1) end
  if b == 0xda or b == 0xc5 then return p + 3 + struct.unpack('>H', v, p + 1) end
  return p + 5 + struct.unpack('>I4', v, p + 1)  -- 0xdb, 0xc6
end

-- The str at `p` and the position after it.
local function mp_str_at(v, p)
  local b, h = string.byte(v, p), 5
  if b >= 0xa0 and b <= 0xbf then h = 1 elseif b == 0xd9 then h = 2 elseif b == 0xda then h = 3 end
  local q = mp_skip(v, p)
  return string.sub(v, p + h, q - 1), q
end

-- The non-negative integer at `p` and the position after it.
local function mp_uint(v, p)
  local b = string.byte(v, p)
  if b < 0x80 then return b, p + 1 end
  if b == 0xcc then return string.byte(v, p + 1), p + 2 end
  if b == 0xcd then return struct.unpack('>H', v, p + 1), p + 3 end
  if b == 0xce then return struct.unpack('>I4', v, p + 1), p + 5 end
  local hi, lo = struct.unpack('>I4I4', v, p + 1)  -- 0xcf
  return hi * 4294967296 + lo, p + 9
end

-- Position of the tokens field of a stored entry.
local function tokens_pos(v)
  local p = 2
  for _ = 1, 5 do p = mp_skip(v, p) end  -- id, modality, role, content, mime
  return p
end

local function tokens_of(val)
  return (mp_uint(val, tokens_pos(val)))
end

-- The links of an entry as {{mod, seq}, ...}.
local function links_of(val)
  local out = {}
  local _, p = mp_uint(val, tokens_pos(val))
  _, p = mp_uint(val, p)  -- size_bytes
  _, p = mp_uint(val, p)  -- ts_ms
  local b, n = string.byte(val, p), 0
  if b >= 0x90 and b <= 0x9f then n, p = b - 0x90, p + 1 else n, p = struct.unpack('>H', val, p + 1), p + 3 end
  for _ = 1, n do
    local link
    link, p = mp_str_at(val, p)
    local mod, seq = string.match(link, '^(.+):(%d+)$')
    if mod then out[#out + 1] = {mod, tonumber(seq)} end  -- (appends check their links)
  end
  return out
end

-- The stored meta of `cid`: the one begin() read with the state if this is that context
-- and it has not been written since (taken once), else its own HGET.
local pre_cid, pre_raw
local pre_vcid, pre_ver    -- or, for a window read, its VER field (begin)
local staged = {}          -- M fields (a meta and its VER field) save() leaves to finish()
local function raw_meta(cid)
  if cid == pre_cid then
    pre_cid = nil
    return pre_raw
  end
  return redis.call('HGET', M, cid)
end

local function load(cid)
  local raw = raw_meta(cid)
  if not raw then return nil end
  return cjson.decode(raw)
end

local function ranges_str(m)
  local parts = {}
  for mod, c in pairs(m.ch) do parts[#parts + 1] = mod .. ':' .. seqstr(c.lo) .. ':' .. seqstr(c.hi) end
  return table.concat(parts, ';')
end

-- Write the meta of `cid`, with its VER field: "<version>;<epoch>;<mod>:<lo>:<hi>;..." —
-- all a window read needs to know of the context (see ops.window).
-- Staged: finish() writes them in the HSET of the principal's state (one Redis call, not two);
-- nothing between a save and its finish reads them back.
local function save(cid, m)
  if cid == pre_cid then pre_cid = nil end
  if cid == pre_vcid then pre_vcid = nil end
  local n = #staged
  staged[n + 1], staged[n + 2] = cid, cjson.encode(m)
  staged[n + 3], staged[n + 4] = VER .. cid, seqstr(m.v) .. ';' .. (m.e or '') .. ';' .. ranges_str(m)
end

local function add_bytes(delta)
  pbytes = pbytes + delta
  pdelta = pdelta + delta
  cdelta = cdelta + delta
end

local function principal_bytes() return pbytes end

-- Read the principal's state (and the meta of `cid`, the context the call is about, if
-- any — or only its VER field for a window read (`ver_only`): one HMGET).
local function begin(cid, ver_only)
  local field = cid and (ver_only and VER .. cid or cid)
  local st
  if GB then  -- with the last global stamp, after the context's field
    if field then st = redis.call('HMGET', M, BYTES, EXP, CLOCK, DUE, field, GSTAMP)
    else st = redis.call('HMGET', M, BYTES, EXP, CLOCK, DUE, GSTAMP) end
    pstamp = tonumber(st[field and 6 or 5])
  elseif field then
    st = redis.call('HMGET', M, BYTES, EXP, CLOCK, DUE, field)
  else
    st = redis.call('HMGET', M, BYTES, EXP, CLOCK, DUE)
  end
  if ver_only then pre_vcid, pre_ver = cid, st[5] elseif cid then pre_cid, pre_raw = cid, st[5] end
  pexp, pclock, pdue = tonumber(st[2]), tonumber(st[3] or '0'), tonumber(st[4])
  pbytes = tonumber(st[1] or '0')
end

-- One server: the call's byte change into the global accounting, and the principal's use
-- into the global LRU when its last stamp is global_lru_resolution_ms old. The stamp's time
-- goes into M with the state (`sargs`), read back by begin(): no read of GL per call. Where
-- M does not have it, GL is asked; where M does not exist (nothing else to write, no TTL
-- yet) it is not written, so M is never created without a TTL.
local function account(sargs)
  if pdelta ~= 0 then
    local d = num(pdelta)
    redis.call('HINCRBY', GB, P, d)
    redis.call('HINCRBY', GB, TOTAL, d)
  end
  if not pstamp then pstamp = tonumber(redis.call('ZSCORE', GL, P)) end
  if pstamp and now >= pstamp and now - pstamp < GRES then return end
  redis.call('ZADD', GL, NOW_S, P)
  if pexp or #sargs > 0 then sargs[#sargs + 1] = GSTAMP; sargs[#sargs + 1] = NOW_S end
  pstamp = now
end

-- Write what this call changed in the state (M: with the metas save() staged, once), and
-- refresh the TTLs when due.
-- keep: the operation counts as activity (keeps the principal's keys alive).
local function finish(keep)
  local sargs = staged
  staged = {}
  if pdelta ~= 0 then
    sargs[#sargs + 1] = BYTES; sargs[#sargs + 1] = num(pbytes)
    if not GB then sargs[#sargs + 1] = CHANGED; sargs[#sargs + 1] = NOW_S end
  end
  if clock_dirty then sargs[#sargs + 1] = CLOCK; sargs[#sargs + 1] = num(pclock); clock_dirty = false end
  if due_dirty and pdue then sargs[#sargs + 1] = DUE; sargs[#sargs + 1] = num(pdue) end
  due_dirty = false
  for cid, s in pairs(used) do sargs[#sargs + 1] = LU .. cid; sargs[#sargs + 1] = num(s) end
  used = {}
  local refresh = keep and (created or not pexp or now < pexp or now - pexp >= SLACK)
  if refresh then sargs[#sargs + 1] = EXP; sargs[#sargs + 1] = NOW_S; pexp = now; created = false end
  if GB then account(sargs) end
  if #sargs > 0 then redis.call('HSET', M, unpack(sargs)) end
  if refresh then
    local ttl = num(IDLE + SLACK)
    for i = 1, 6 do redis.call('PEXPIRE', KEYV[i], ttl) end
  end
  pdelta = 0
end

-- Error reply after writing what already changed (idle evictions before the error), which
-- it names after ' ;evicted ' as (cid, reason) pairs: the caller reports them as for a reply.
local function fail(msg)
  finish(false)
  if #evicted > 0 then
    local parts = {msg, ';evicted'}
    for _, e in ipairs(evicted) do parts[#parts + 1] = e[1]; parts[#parts + 1] = e[2] end
    msg = table.concat(parts, ' ')
  end
  error({err = msg})
end

-- Physically delete entries a..b of a channel; returns the bytes freed.
local function del_range(cid, mod, a, b)
  local freed, batch = 0, {}
  for s = a, b do
    local f = efield(cid, mod, s)
    local n = redis.call('HSTRLEN', E, f)
    if n > 0 then freed = freed + n - name_len(mod, s) end
    batch[#batch + 1] = f
    if #batch >= 512 then redis.call('HDEL', E, unpack(batch)); batch = {} end
  end
  if #batch > 0 then redis.call('HDEL', E, unpack(batch)) end
  return freed
end

local function del_versions(cid, a, b)
  local batch = {}
  for v = a, b do
    batch[#batch + 1] = cid .. '|' .. v
    if #batch >= 512 then redis.call('HDEL', V, unpack(batch)); batch = {} end
  end
  if #batch > 0 then redis.call('HDEL', V, unpack(batch)) end
end

-- S keeps the last version of evicted contexts. It is created by the first eviction, so it
-- gets the principal's idle TTL then (the other keys get theirs when they are created).
local function remember_version(cid, v)
  redis.call('HSET', S, cid, v)
  if redis.call('PTTL', S) == -1 then redis.call('PEXPIRE', S, num(IDLE + SLACK)) end
end

-- Remove a whole context in this call (never half of it), remember its last version.
local function drop_context(cid, m, reason)
  local freed = 0
  for mod, c in pairs(m.ch) do freed = freed + del_range(cid, mod, c.plo, c.hi) end
  del_versions(cid, m.vf, m.v)
  if cid == pre_cid then pre_cid = nil end
  if cid == pre_vcid then pre_vcid = nil end
  used[cid] = nil
  redis.call('HDEL', M, cid, LU .. cid, VER .. cid)
  redis.call('ZREM', R, cid)
  remember_version(cid, m.v)
  add_bytes(-freed)
  audit('evict', cid, m.v, {'reason', reason, 'bytes', freed})
  evicted[#evicted + 1] = {cid, reason}
end

local function parse_ranges(s)
  local out = {}
  if s then
    for mod, lo, hi in string.gmatch(s, '([^:;]+):(%d+):(%d+)') do out[mod] = {tonumber(lo), tonumber(hi)} end
  end
  return out
end

-- Free entries no retained version can see any more (lo is monotonic per channel, so the
-- oldest retained version holds the smallest lo of every channel it has).
local function collect(cid, m)
  local oldest = parse_ranges(redis.call('HGET', V, cid .. '|' .. m.vf))
  local freed = 0
  for mod, c in pairs(m.ch) do
    local r = oldest[mod]
    if r and r[1] > c.plo then
      freed = freed + del_range(cid, mod, c.plo, r[1] - 1)
      c.plo = r[1]
    end
  end
  m.b = m.b - freed
  add_bytes(-freed)
end

local function bump(cid, m)
  m.v = m.v + 1
  redis.call('HSET', V, cid .. '|' .. m.v, ranges_str(m))
  if m.v - m.vf + 1 > NVER then
    del_versions(cid, m.vf, m.v - NVER)
    m.vf = m.v - NVER + 1
  end
  collect(cid, m)
end

-- Use of a context: it becomes the principal's MRU (last use = now * K, strictly
-- increasing), written to M by finish(); R gets it only for a context new to R (`new`) —
-- elsewhere R catches up lazily (lru_head). (The principal's place in the global LRU is
-- stamped by finish() on one server, by the store on a cluster: shared/context/budget.py.)
local function touch(cid, new)
  local s = now * K
  if s <= pclock then s = pclock + 1 end
  pclock = s
  clock_dirty = true
  if not pdue then pdue = math.floor(s / K) + IDLE; due_dirty = true end  -- R was empty
  used[cid] = s
  if new then redis.call('ZADD', R, num(s), cid) end
end

-- The principal's least recently used context other than `skip`, and its last use: R's
-- head once its score is exact. A head used since its score was written moves to its place
-- first (each use is caught up at most once: the cost of a lazy R is paid here, rarely).
local function lru_head(skip)
  while true do
    local h = redis.call('ZRANGE', R, 0, 1, 'WITHSCORES')
    local cid, sc = h[1], h[2]
    if cid ~= nil and cid == skip then cid, sc = h[3], h[4] end
    if not cid then return nil end
    sc = tonumber(sc)
    local t = used[cid] or tonumber(redis.call('HGET', M, LU .. cid) or '0')
    if t <= sc then return cid, sc end
    redis.call('ZADD', R, num(t), cid)
  end
end

-- Lazy per-context idle expiry: contexts whose last use (score / K) is idle_ttl ago.
-- `pdue` is a time before which none can be idle: the oldest context's last use + idle_ttl
-- when last looked at. Uses only make contexts younger and evictions only remove them, so
-- it stays a lower bound, and until then a call does no idle check at all (no Redis call).
local function expire_idle()
  if pdue and now < pdue then return end
  local cut = (now - IDLE + 1) * K  -- last use before this: idle
  local cid, sc = lru_head(nil)
  while cid and sc < cut do
    local m = load(cid)
    if m then drop_context(cid, m, 'idle') else redis.call('ZREM', R, cid) end
    cid, sc = lru_head(nil)
  end
  if cid then pdue = math.floor(sc / K) + IDLE else pdue = nil end
  due_dirty = true
end

-- Exact LRU over the principal's contexts; `keep` (just written, MRU) goes last.
local function enforce_principal(keep, km)
  while principal_bytes() > P_BUD do
    local victim = lru_head(keep)
    if not victim then break end
    local vm = load(victim)
    if vm then drop_context(victim, vm, 'principal_budget') else redis.call('ZREM', R, victim) end
  end
  if principal_bytes() <= P_BUD then return end
  -- `keep` alone is over budget: give up retained versions first, then its oldest entries.
  if km.vf < km.v then
    del_versions(keep, km.vf, km.v - 1)
    km.vf = km.v
    collect(keep, km)
  end
  while principal_bytes() > P_BUD do
    local best, bmod = nil, nil
    for mod, c in pairs(km.ch) do
      if c.lo < c.hi and (best == nil or c.lo < best) then best, bmod = c.lo, mod end
    end
    if not bmod then break end
    local c = km.ch[bmod]
    local freed = del_range(keep, bmod, c.lo, c.lo)
    c.lo = c.lo + 1; c.plo = c.lo; c.lb = c.lb - freed
    km.b = km.b - freed
    add_bytes(-freed)
  end
  redis.call('HSET', V, keep .. '|' .. km.v, ranges_str(km))
end

-- A new context (or a new life of an evicted one). `e` (epoch) names this life: sequence
-- numbers restart only in a new life, so (epoch, modality, seq) names one entry's content
-- for ever — what lets a reader keep entries it has and fetch only the rest (ops.window).
-- Redis's clock in µs plus the version: unique even after Redis lost its data.
local function new_meta(cid)
  local last = tonumber(redis.call('HGET', S, cid) or '0')
  local t = redis.call('TIME')
  return {v = last, vf = last + 1, b = 0, t = now, ch = {}, e = string.format('%d.%s%06d', last + 1, t[1], t[2])}
end

local function need(cid)
  local m = load(cid)
  if not m then fail('LM_NOTFOUND context ' .. cid) end
  return m
end

local function hmget_range(cid, mod, a, b)
  local fields, pre, n = {}, efield(cid, mod, ''), 0
  for s = a, b do n = n + 1; fields[n] = pre .. (SEQS[s] or seqstr(s)) end
  return redis.call('HMGET', E, unpack(fields))
end

-- Window replies are runs of consecutive entries of one channel, flat:
-- {mod, first seq, {value, value, ...}, mod, first seq, {...}, ...}. Values go out as they
-- came from HMGET (no copying or packing in Lua: packing costs a quarter of a read), and
-- an HMGET reply is itself a run's value table (no per-entry work in Lua at all).
local function add_run(out, mod, first, vals)
  out[#out + 1] = mod; out[#out + 1] = first; out[#out + 1] = vals
end

-- Runs of the entries a..b of a channel (nothing when b < a). An entry that is not stored
-- — never expected: the entries of a range are written and deleted together — stays in its
-- run as false (nil in the reply) and the client splits the run there: no pass over the
-- values here (a loop of Lua per entry cost a read ~3% of its Redis instructions).
local function fetch(cid, mod, a, b, out)
  for x = a, b, 1000 do add_run(out, mod, x, hmget_range(cid, mod, x, math.min(b, x + 999))) end
end

-- The window of a channel: its range lo..hi cut to the last `last_n` entries and/or to a
-- token budget walked newest first. Runs of its entries go to `out`, except those the
-- caller holds (`held` = {first, last}, or nil). Returns the window's first and last seq,
-- or nothing when it is empty.
local function read_channel(cid, mod, lo, hi, last_n, max_tokens, out, held)
  if last_n > 0 and hi - last_n + 1 > lo then lo = hi - last_n + 1 end
  if hi < lo then return end
  local ha, hb = 1, 0
  if held then ha, hb = held[1], held[2] end
  if max_tokens > 0 then
    local picked, used = {}, 0
    for s = hi, lo, -1 do
      local val = redis.call('HGET', E, efield(cid, mod, s))
      if not val then break end
      local tok = tokens_of(val)
      if used + tok > max_tokens and #picked > 0 then break end
      used = used + tok
      picked[#picked + 1] = {s, val}
      if used >= max_tokens then break end
    end
    if #picked == 0 then return end
    local run
    for i = #picked, 1, -1 do
      local s = picked[i][1]
      if s >= ha and s <= hb then run = nil
      elseif run then run[#run + 1] = picked[i][2]
      else run = {picked[i][2]}; add_run(out, mod, s, run) end
    end
    return picked[#picked][1], hi
  end
  fetch(cid, mod, lo, math.min(hi, ha - 1), out)
  fetch(cid, mod, math.max(lo, hb + 1), hi, out)
  return lo, hi
end

local NONE = {}  -- shared empty table (never written): spares a table per call

-- Add entries of requested channels that returned entries link to (within `ranges`),
-- each as a run of its own.
local function resolve(cid, ranges, wanted, out)
  local have = {}
  local n = #out
  for i = 1, n, 3 do
    for k = 1, #out[i + 2] do have[out[i] .. ':' .. (out[i + 1] + k - 1)] = true end
  end
  for i = 1, n, 3 do
    for _, val in ipairs(out[i + 2]) do
      for _, l in ipairs(val and links_of(val) or NONE) do
        local key = l[1] .. ':' .. l[2]
        local r = ranges[l[1]]
        if wanted[l[1]] and r and not have[key] and l[2] >= r[1] and l[2] <= r[2] then
          local v = redis.call('HGET', E, efield(cid, l[1], l[2]))
          if v then add_run(out, l[1], l[2], {v}); have[key] = true end
        end
      end
    end
  end
end

-- Append the runs in `out` (see add_run) to the flat `reply`: (mod, first seq, count,
-- values...) each. (Joining a run's values into one string here cost Redis ~700 more
-- instructions per entry: the client joins them.)
local function runs_reply(reply, out)
  for i = 1, #out, 3 do
    local vals = out[i + 2]
    reply[#reply + 1] = out[i]; reply[#reply + 1] = out[i + 1]; reply[#reply + 1] = #vals
    for k = 1, #vals do reply[#reply + 1] = vals[k] end
  end
  return reply
end


local function wanted_set(csv)
  if csv == '' then return {}, true end
  local w = {}
  for mod in string.gmatch(csv, '[^,]+') do w[mod] = true end
  return w, false
end

-- The (cid, reason) pairs of this call's evictions, appended to `out` (a new table if nil).
local function evicted_reply(out)
  out = out or {}
  for _, e in ipairs(evicted) do out[#out + 1] = e[1]; out[#out + 1] = e[2] end
  return out
end

-- ------------------------------------------------------------------ operations
local ops = {}

-- The meta keeps the request ids of a context's last RIDS appends that named one, as
-- {id, modality, seq, version} in m.q (newest last): an append naming one of them is a retry.
local RIDS = 8

local function repeated(m, rid)
  if rid == '' or not m or not m.q then return nil end
  for _, q in ipairs(m.q) do
    if q[1] == rid then return q end
  end
  return nil
end

local function remember_request(m, rid, mod, seq)
  if rid == '' then return end
  local q = m.q or {}
  q[#q + 1] = {rid, mod, seq, m.v}
  if #q > RIDS then table.remove(q, 1) end
  m.q = q
end

-- ARGV 5 cid, 6 modality, 7 entry body (see stored entries), 8 links csv, 9 request id ('' for
-- none) -> {seq, version, evicted, delta, opened, modality} (opened: 1 when the channel held no
-- entry before, so the caller's resource list grew). An append whose request id is one of the
-- context's last RIDS appends' appends nothing and answers that append's {seq, version, ...,
-- its modality}; modality is '' otherwise.
function ops.append()
  local cid, mod, val, links, rid = ARGS[5], ARGS[6], ARGS[7], ARGS[8], ARGS[9] or ''
  local m = load(cid)
  local again = repeated(m, rid)
  if again then
    touch(cid)
    finish(true)
    return {again[3], again[4], evicted_reply(), cdelta, 0, again[2]}
  end
  local new = not m
  if new then m = new_meta(cid); created = true end
  for link in string.gmatch(links, '[^,]+') do
    local l, seq = string.match(link, '^([^:]+):(%d+)$')
    local c = l and m.ch[l]
    seq = tonumber(seq)
    if not c or seq < c.lo or seq > c.hi then fail('LM_BADLINK no entry ' .. link) end
  end
  if pbytes == 0 then created = true end  -- the entries hash is (re)created
  local c = m.ch[mod]
  if not c then c = {lo = 1, hi = 0, plo = 1, lb = 0}; m.ch[mod] = c end
  local opened = c.lo > c.hi and 1 or 0
  local seq = c.hi + 1
  redis.call('HSET', E, efield(cid, mod, seq), stored_entry(mod, seq, val))
  c.hi = seq
  c.lb = c.lb + #val
  m.b = m.b + #val
  add_bytes(#val)
  while c.lo < c.hi and (c.hi - c.lo + 1 > CH_N or c.lb > CH_B) do
    c.lb = c.lb - redis.call('HSTRLEN', E, efield(cid, mod, c.lo)) + name_len(mod, c.lo)
    c.lo = c.lo + 1
  end
  touch(cid, new)
  bump(cid, m)
  enforce_principal(cid, m)
  remember_request(m, rid, mod, seq)
  save(cid, m)
  audit('append', cid, m.v, {'entry', mod .. ':' .. seqstr(seq), 'bytes', #val})
  finish(true)
  return {seq, m.v, evicted_reply(), cdelta, opened, ''}
end

-- Entries the caller already holds, from ARGV "<epoch>;mod:first:last;...": honoured only
-- for this context's current life (`epoch`, see new_meta), else nothing is held.
local function held_set(spec, epoch)
  if not spec or spec == '' or epoch == '' then return NONE end
  -- One channel (the usual read) in one match: a match plus a gmatch loop took 0.8-1.6 µs,
  -- one match with every capture 0.7 µs (the VER field is parsed the same way).
  local ep, mod, a, b, rest = string.match(spec, '^([^;]*);([^:;]+):(%d+):(%d+)(.*)$')
  if ep and rest == '' then
    if ep ~= epoch then return NONE end
    return {[mod] = {tonumber(a), tonumber(b)}}
  end
  ep, rest = string.match(spec, '^([^;]*);?(.*)$')
  if ep ~= epoch then return NONE end
  local held = {}
  for mod, a, b in string.gmatch(rest, '([^:;]+):(%d+):(%d+)') do held[mod] = {tonumber(a), tonumber(b)} end
  return held
end

-- ARGV 5 cid, 6 modalities csv, 7 last_n, 8 max_tokens, 9 resolve(0/1), 10 held entries
--   (see held_set; ignored when resolving links), 11 the VER value the caller got at its
--   last read with these same arguments, or "" -> one flat array (converting each nested
--   table of a reply cost Redis ~3,000 instructions): {version, VER (see M: the caller
--   sends it back as ARGV 11 next time), number of windows,
--   (mod, first seq, last seq) per non-empty window, number of evicted, (cid, reason) per
--   eviction, then runs of the entries not held (see runs_reply)...}.
--   If the context is still at ARGV 11 — so the window is the caller's last one — only
--   {0, '', -1, number of evicted, (cid, reason)...}: the use is recorded. Never decodes
--   the meta (its VER field has the channel ranges: 9% fewer Redis instructions for a read
--   after an append), unless it was written before VER had them. Does not rewrite the meta.
function ops.window()
  local cid = ARGS[5]
  local ver = pre_vcid == cid and pre_ver or nil  -- nil too if this call evicted it (idle)
  if ver and ver == ARGS[11] then
    touch(cid)
    finish(true)
    return evicted_reply({0, '', -1, #evicted})
  end
  local v, epoch, ranges
  if ver then
    local mod, lo, hi, rest
    v, epoch, mod, lo, hi, rest = string.match(ver, '^(%d+);([^;]*);([^:;]+):(%d+):(%d+)(.*)$')
    if v and rest == '' then  -- one channel (see held_set)
      v, ranges = tonumber(v), {[mod] = {tonumber(lo), tonumber(hi)}}
    else
      v, epoch, ranges = string.match(ver, '^(%d+);([^;]*);(.*)$')
      if v then v, ranges = tonumber(v), parse_ranges(ranges) end
    end
  end
  if not v then  -- no context, or a VER field of the short form ("<version>;<epoch>")
    local m = load(cid)
    if not m then fail('LM_NOTFOUND context ' .. cid) end
    v, epoch, ranges = m.v, m.e or '', {}
    for mod, c in pairs(m.ch) do ranges[mod] = {c.lo, c.hi} end
    ver = v .. ';' .. epoch
  end
  local wanted, all = wanted_set(ARGS[6])
  local last_n, max_tokens = tonumber(ARGS[7]), tonumber(ARGS[8])
  local resolving = ARGS[9] == '1'
  local held = resolving and NONE or held_set(ARGS[10], epoch)
  local out, reply = {}, {v, ver, 0}
  for mod, r in pairs(ranges) do
    if all or wanted[mod] then
      if resolving then wanted[mod] = true end
      local a, b = read_channel(cid, mod, r[1], r[2], last_n, max_tokens, out, held[mod])
      if a then
        reply[#reply + 1] = mod; reply[#reply + 1] = a; reply[#reply + 1] = b
        reply[3] = reply[3] + 1
      end
    end
  end
  if resolving then resolve(cid, ranges, wanted, out) end
  touch(cid)
  finish(true)
  if #out == 3 and #reply == 6 and #evicted == 0 then
    -- The usual read (one channel, one run, no eviction): the reply in one table constructor,
    -- its values copied by the VM in C, not by a loop of Lua (~4% of a read's instructions).
    local vals = out[3]
    return {reply[1], reply[2], 1, reply[4], reply[5], reply[6], 0, out[1], out[2], #vals, unpack(vals)}
  end
  reply[#reply + 1] = #evicted
  evicted_reply(reply)
  return runs_reply(reply, out)
end

-- ARGV 5 cid, 6 version, 7 modalities csv -> {version, evicted, runs (as in ops.window)...}
function ops.read_at()
  local cid, ver = ARGS[5], tonumber(ARGS[6])
  local m = load(cid)
  if not m or ver < m.vf or ver > m.v then
    fail('LM_VERSION context ' .. cid .. ' version ' .. ARGS[6] .. ' is not retained')
  end
  local wanted, all = wanted_set(ARGS[7])
  local out = {}
  for mod, r in pairs(parse_ranges(redis.call('HGET', V, cid .. '|' .. ver))) do
    if all or wanted[mod] then read_channel(cid, mod, r[1], r[2], 0, 0, out, nil) end
  end
  touch(cid)
  finish(true)
  return runs_reply({ver, evicted_reply()}, out)
end

-- ARGV 5 cid -> {version, evicted}
function ops.version()
  local m = need(ARGS[5])
  finish(false)
  return {m.v, evicted_reply(), cdelta}
end

-- -> {{cid, meta json}..., {cid, last-use score}..., evicted}
-- The {cid, meta json} pairs of M (its state fields, which start with \0, left out).
-- Also returns cid -> last use from the "\0u<cid>" fields.
local function metas()
  local raw, out, last = redis.call('HGETALL', M), {}, {}
  for i = 1, #raw, 2 do
    local f = raw[i]
    if string.byte(f, 1) ~= 0 then
      out[#out + 1] = f; out[#out + 1] = raw[i + 1]
    elseif string.sub(f, 1, 2) == LU then
      last[string.sub(f, 3)] = tonumber(raw[i + 1])
    end
  end
  return out, last
end

function ops.list()
  local raw, last = metas()
  local lru = redis.call('ZRANGE', R, 0, -1, 'WITHSCORES')
  for i = 1, #lru, 2 do  -- R's lower bounds brought up to date in the reply (R stays as it is)
    local t = last[lru[i]]
    if t and t > tonumber(lru[i + 1]) then lru[i + 1] = num(t) end
  end
  finish(false)
  return {raw, lru, evicted_reply()}
end

-- ARGV 5 cid -> {version, evicted, delta}
function ops.clear()
  local cid = ARGS[5]
  local m = need(cid)
  for _, c in pairs(m.ch) do c.lo = c.hi + 1; c.lb = 0 end
  touch(cid)
  bump(cid, m)
  save(cid, m)
  audit('clear', cid, m.v)
  finish(true)
  return {m.v, evicted_reply(), cdelta}
end

-- ARGV 5 src, 6 dst -> {version of dst, evicted, delta}
function ops.fork()
  local src, dst = ARGS[5], ARGS[6]
  local sm = need(src)
  if redis.call('HEXISTS', M, dst) == 1 then fail('LM_EXISTS context ' .. dst .. ' exists') end
  local dm = new_meta(dst)
  for mod, c in pairs(sm.ch) do
    local nc = {lo = c.lo, hi = c.hi, plo = c.lo, lb = c.lb}
    dm.ch[mod] = nc
    for a = c.lo, c.hi, 1000 do
      local vals = hmget_range(src, mod, a, math.min(c.hi, a + 999))
      local pairs_ = {}
      for i = 1, #vals do
        if vals[i] then pairs_[#pairs_ + 1] = efield(dst, mod, a + i - 1); pairs_[#pairs_ + 1] = vals[i] end
      end
      if #pairs_ > 0 then redis.call('HSET', E, unpack(pairs_)) end
    end
    dm.b = dm.b + c.lb
  end
  add_bytes(dm.b)
  touch(src)
  touch(dst, true)
  bump(dst, dm)
  enforce_principal(dst, dm)
  save(dst, dm)
  audit('fork', dst, dm.v, {'source', src, 'source_version', sm.v, 'bytes', dm.b})
  finish(true)
  return {dm.v, evicted_reply(), cdelta}
end

-- ARGV 5 cid, 6 reason -> {1|0, evicted, delta}
function ops.evict()
  local m = load(ARGS[5])
  if not m then finish(false); return {0, evicted_reply(), cdelta} end
  drop_context(ARGS[5], m, ARGS[6])
  finish(false)
  return {1, evicted_reply(), cdelta}
end

-- Global budget (shared/context/budget.py): drop every context of principal P unless it was
-- used after ARGV 5 (ms: the last use the evictor saw) -> {contexts dropped (-1: skipped),
-- bytes freed}. One call: the principal's contexts go together or not at all. On one server
-- the principal's report goes too (whatever it was), it leaves GL for GS, and the reply
-- has a third element: the report cleared.
function ops.evict_principal()
  local st = redis.call('HMGET', M, BYTES, CLOCK)
  if tonumber(st[2] or '0') > tonumber(ARGS[5]) * K + K - 1 then return {-1, 0} end
  local raw = metas()
  for i = 1, #raw, 2 do
    local m = cjson.decode(raw[i + 1])
    remember_version(raw[i], m.v)
    audit('evict', raw[i], m.v, {'reason', ARGS[6], 'bytes', m.b})
  end
  redis.call('DEL', E, M, R, V)  -- the state in M goes too: as for a new principal
  if not GB then return {#raw / 2, tonumber(st[1] or '0')} end
  local reported = tonumber(redis.call('HGET', GB, P) or '0')
  redis.call('HDEL', GB, P)
  if reported ~= 0 then redis.call('HINCRBY', GB, TOTAL, num(-reported)) end
  redis.call('ZREM', GL, P)
  redis.call('ZADD', GS, ARGS[5], P)
  return {#raw / 2, tonumber(st[1] or '0'), reported}
end

local function run_op(fn)
  if op ~= 'evict_principal' then
    begin(op ~= 'list' and ARGS[5] or nil, op == 'window')
    expire_idle()
  end
  return fn()
end

-- The entry point: FCALL <fn> <6 or 9> KEYS... ARGV... (or, on Redis < 7, EVALSHA of this body
-- followed by `return lm_main(KEYS, ARGV)`; see shared/context/scripts.py).
local function lm_main(keys, args)
  KEYV, ARGS = keys, args
  E, M, R, V, S, AU = keys[1], keys[2], keys[3], keys[4], keys[5], keys[6]
  GB, GL, GS = keys[7], keys[8], keys[9]
  op, P, NOW_S = args[1], args[2], args[4]
  now = tonumber(NOW_S)
  if args[3] ~= CFG then             -- parsed once per configuration (the library stays loaded)
    local a, b, c, e, f, g, h = string.match(args[3], '^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+)$')
    if not a then return redis.error_reply('LM_BADCONFIG ' .. tostring(args[3])) end
    CH_N, CH_B, P_BUD = tonumber(a), tonumber(b), tonumber(c)
    IDLE, NVER, AMAX, GRES = tonumber(e), tonumber(f), g, tonumber(h)
    SLACK = math.floor(IDLE / 16)  -- TTL refresh granularity (see header)
    CFG = args[3]
  end
  evicted = {}
  pbytes, pexp, pclock, pdelta, pdue, due_dirty, pstamp = 0, nil, 0, 0, nil, false, nil
  used, cdelta = {}, 0
  pre_cid, pre_raw, pre_vcid, pre_ver = nil, nil, nil, nil
  clock_dirty, created, staged = false, false, {}
  local fn = ops[op]
  if not fn then return redis.error_reply('LM_BADOP ' .. tostring(op)) end
  -- fail() raises {err = ...}; turned into an error reply here rather than raised out of the
  -- script: Redis 7 Functions accept a raised error table, Redis 6 EVAL (the fallback) does not.
  local ok, res = pcall(run_op, fn)
  if ok then return res end
  if type(res) == 'table' and res.err then return redis.error_reply(res.err) end
  error(res, 0)
end
