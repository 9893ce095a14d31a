"""Lua scripts of the bus: each runs atomically in Redis, so no other client sees a half-done step."""

# Atomic: the duplicate check, the capacity check and the add cannot interleave with another producer, so
# two feeders racing on one id add it once, and the stream never grows past maxlen.
# Returns 0 (duplicate), -1 (full), or the new entry id.
PUBLISH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('XLEN', KEYS[2]) >= tonumber(ARGV[2]) then return -1 end
local id = redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'payload', ARGV[4])
redis.call('SET', KEYS[1], id, 'PX', ARGV[1])
return id
"""

# XACK first: only an entry still pending is dead-lettered, so a retry after a lost reply (or a race with
# a consumer that did finish it) records nothing twice. Returns 1 if dead-lettered, 0 if not pending.
DEAD_LETTER_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'stream', KEYS[1], 'entry_id', ARGV[2],
  'id', ARGV[4], 'reason', ARGV[5], 'payload', ARGV[6], 'time_ms', ARGV[7], 'deliveries', ARGV[8])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# A prompt a producer refused to publish (over the prompt limits), recorded in the dead-letter stream with
# its reason, once: its dedup mark is set as a published prompt's is, so feeding the file again (an epoch,
# a refeed after a wipe) records nothing twice. The payload is not kept (it may be megabytes). Returns 1 if
# recorded, 0 if this id was published (or refused) before.
REFUSED_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'stream', ARGV[2], 'entry_id', '-',
  'id', ARGV[3], 'reason', ARGV[4], 'payload', '', 'time_ms', ARGV[5], 'deliveries', 0)
redis.call('SET', KEYS[1], 'refused', 'PX', ARGV[6])
return 1
"""

# A dead letter back into the stream it came from, as a new entry with its id and payload (not through the
# dedup check: its id was published before). Returns the new entry id, or false when the record is gone.
REQUEUE_LUA = """
local rows = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #rows == 0 then return false end
local fields, values = rows[1][2], {}
for i = 1, #fields, 2 do values[fields[i]] = fields[i + 1] end
local id = redis.call('XADD', values['stream'], '*', 'id', values['id'], 'payload', values['payload'])
redis.call('XDEL', KEYS[1], ARGV[1])
return id
"""

# A trajectory group dropped and its prompt fed again, in one step (a crash between the two would lose
# the prompt): XACK first, so only a group still pending is sent back and a retried call does nothing
# twice. The group's dedup mark goes, so the group made again (same id) is accepted; the prompt goes in
# past the stream's cap, as a requeue does (the learner holds at most its reach of such groups), and its
# mark names the new entry. Returns 1 if sent back, 0 if the group was not pending.
SEND_BACK_LUA = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[3])
local id = redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'payload', ARGV[4])
redis.call('SET', KEYS[4], id, 'PX', ARGV[5])
return 1
"""
