-- The statements that change a record, each written once. They are
-- text/templates rendered twice: into statements the Store prepares, whose
-- parameters are $1, $2, …, and into the bodies of the functions of
-- schema.sql, whose parameters are the functions' own (p_scope, p_key, …),
-- which instances of an earlier version call. Every template is given the
-- table's names (see names in store.go) and the names of its parameters
-- (see params in statements.go).

-- owned: row t is the record of the key, in flight under the token, and
-- not expired. A write that finds its row by key tests the state as
-- state || '' = 'in_progress', an expression the partial index of records
-- in flight cannot serve: with millions of completed records its
-- statistics can make that index look nearly empty, and a plan that walked
-- it would visit every record in flight on each write, not the one row the
-- primary key finds.
{{define "owned" -}}
t.scope = {{.Scope}} AND t.key = {{.Key}} AND t.token = {{.Token}} AND t.state || '' = 'in_progress' AND t.expires_at > now()
{{- end}}

-- leaseHeld: in the caller's transaction ({{.InTx}}), now() is when the
-- transaction began: the lease is judged by the clock at the statement.
{{define "leaseHeld" -}}
(NOT {{.InTx}} OR t.lease_until > clock_timestamp())
{{- end}}

-- The statements that settle a record (complete, release, forget) answer
-- whether a waiter registered on it: their caller then wakes the waiters
-- (wakeID), in the same transaction when there is one.

-- complete stores the outcome, restarts the retention, and drops the
-- recovery points.
{{define "complete" -}}
UPDATE {{.Table}} t SET state = 'completed', response = {{.Response}}, points = NULL,
        expires_at = now() + {{.RetentionUS}} * interval '1 microsecond'
    WHERE {{template "owned" .}} AND {{template "leaseHeld" .}}
    RETURNING t.waiters
{{- end}}

{{define "release" -}}
UPDATE {{.Table}} t SET state = 'released' WHERE {{template "owned" .}} RETURNING t.waiters
{{- end}}

-- forget expires the record rather than delete it: it counts as absent at
-- once, and DeleteExpired deletes it after its grace (see the claim
-- function), counted from created_at, which for a forgotten record says
-- when it was forgotten. Its recovery points go at once.
{{define "forget" -}}
UPDATE {{.Table}} t SET state = 'released', expires_at = '-infinity', created_at = now(), points = NULL
    WHERE {{template "owned" .}}
    RETURNING t.waiters
{{- end}}

-- wakeID names the record in the notifications that wake its waiters: the
-- first 16 bytes of SHA-256(scope, NUL, key) in hex. A notification
-- carries at most 8000 bytes, and text holds no NUL, so the pair is
-- encoded without ambiguity. (The Store's wakeID says the same in Go.)
{{define "wakeID" -}}
encode(substring(sha256(convert_to({{.Scope}}, 'UTF8') || decode('00', 'hex') || convert_to({{.Key}}, 'UTF8')) FROM 1 FOR 16), 'hex')
{{- end}}

-- heartbeat renews the lease for {{.LeaseUS}} from now, and moves the
-- expiry with it, as idempotency.Store.Heartbeat says (SET reads the row
-- as it was). A lease of 0 abandons the record: no later claim's now()
-- precedes this one's.
{{define "heartbeat" -}}
UPDATE {{.Table}} t SET lease_until = now() + {{.LeaseUS}} * interval '1 microsecond',
        expires_at = greatest(t.expires_at + greatest(now() + {{.LeaseUS}} * interval '1 microsecond' - t.lease_until, interval '0'),
            now() + {{.LeaseUS}} * interval '1 microsecond')
    WHERE {{template "owned" .}}
{{- end}}

-- point appends the entry of one recovery point (internal/wire) to the
-- record's. An entry of a step saved before is appended too, and the
-- reader skips it: the first entry of a step is the one that counts. The
-- points begin with the operation ID they belong to ({{.PointsHead}}):
-- points under another operation ID are an earlier record's of the key,
-- left by a function of an earlier version that did not clear them, and
-- count as none, so they are overwritten.
{{define "point" -}}
UPDATE {{.Table}} t SET points = CASE
        WHEN substring(t.points FROM 1 FOR octet_length({{.PointsHead}})) = {{.PointsHead}} THEN t.points || {{.Entry}}
        ELSE {{.PointsHead}} || {{.Entry}} END
    WHERE {{template "owned" .}} AND {{template "leaseHeld" .}}
{{- end}}
