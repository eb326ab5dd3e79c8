package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"

	"github.com/idempotency-go/idempotency"
)

// chargeRequest is the body of POST /v1/charges.
type chargeRequest struct {
	Amount   int64  `json:"amount"`   // in the currency's smallest unit
	Currency string `json:"currency"` // ISO 4217, lower case
	Source   string `json:"source"`   // a card token
}

// api serves the payments API. Everything it keeps is in the gateway and the
// ledger, which every instance shares, so any number of instances act as
// one service.
type api struct {
	gateway gateway
	ledger  ledger
}

// routes mounts the API. Only POST /v1/charges is guarded: its handler runs
// at most once per (X-Account-ID, Idempotency-Key), on whichever instance.
func (a *api) routes(guard *idempotency.Guard) http.Handler {
	guarded := guard.Middleware(idempotency.MiddlewareOptions{
		// Keys belong to an account: two accounts never share a record,
		// whatever keys their clients choose.
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", guarded(http.HandlerFunc(a.createCharge)))
	mux.HandleFunc("GET /v1/charges", a.listCharges)
	mux.HandleFunc("GET /v1/charges/{id}", a.getCharge)
	mux.HandleFunc("GET /v1/gateway", a.gatewayStats)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	return mux
}

func (a *api) createCharge(w http.ResponseWriter, r *http.Request) {
	req, err := decodeChargeRequest(r.Body)
	if err != nil {
		// 400 is forgotten by the middleware: the client may correct the
		// body and send it again under the same key.
		writeProblem(w, http.StatusBadRequest, "invalid-charge", "Invalid charge", err.Error())
		return
	}
	ctx := r.Context()
	// The provider's key comes from the operation, not from the client's
	// key: every attempt at this operation, on any instance, sends the same
	// one, so a takeover after a crash gets the original charge back
	// instead of charging the card twice.
	c, err := a.gateway.charge(ctx, idempotency.DownstreamKey(ctx, "gateway"), req)
	if err != nil {
		// A 5xx releases the key: the client's retry calls the gateway
		// again, with the same downstream key.
		log.Printf("gateway: %v", err)
		writeProblem(w, http.StatusServiceUnavailable, "gateway-unavailable", "Payment gateway unavailable",
			"The payment gateway could not be reached; retry with the same Idempotency-Key.")
		return
	}
	// The fencing token lets the ledger refuse an attempt that was taken
	// over (it stalled past its lease) and wakes up late.
	info, _ := idempotency.FromContext(ctx) // always there: the route is guarded
	if err := a.ledger.record(ctx, c, info.Token); err != nil {
		log.Printf("ledger: %v", err)
		writeProblem(w, http.StatusServiceUnavailable, "ledger-unavailable", "Charge not recorded",
			"The charge could not be recorded; retry with the same Idempotency-Key.")
		return
	}
	w.Header().Set("Location", "/v1/charges/"+c.ID)
	writeJSON(w, http.StatusCreated, c)
}

// decodeChargeRequest reads exactly one JSON object with known fields and
// valid values.
func decodeChargeRequest(body io.Reader) (chargeRequest, error) {
	var req chargeRequest
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, fmt.Errorf("body: %w", err)
	}
	if dec.Decode(&struct{}{}) != io.EOF {
		return req, errors.New("body: more than one JSON value")
	}
	switch {
	case req.Amount <= 0:
		return req, errors.New("amount: must be a positive integer")
	case !isCurrency(req.Currency):
		return req, errors.New("currency: must be three lower-case letters")
	case req.Source == "":
		return req, errors.New("source: required")
	}
	return req, nil
}

func isCurrency(s string) bool {
	if len(s) != 3 {
		return false
	}
	for i := range len(s) {
		if s[i] < 'a' || s[i] > 'z' {
			return false
		}
	}
	return true
}

func (a *api) listCharges(w http.ResponseWriter, r *http.Request) {
	charges, err := a.ledger.list(r.Context())
	if err != nil {
		internalError(w, "ledger", err)
		return
	}
	writeJSON(w, http.StatusOK, charges)
}

func (a *api) getCharge(w http.ResponseWriter, r *http.Request) {
	c, err := a.ledger.get(r.Context(), r.PathValue("id"))
	switch {
	case errors.Is(err, errNotFound):
		writeProblem(w, http.StatusNotFound, "no-such-charge", "No such charge", "There is no charge with this id.")
	case err != nil:
		internalError(w, "ledger", err)
	default:
		writeJSON(w, http.StatusOK, c)
	}
}

func (a *api) gatewayStats(w http.ResponseWriter, r *http.Request) {
	s, err := a.gateway.stats(r.Context())
	if err != nil {
		internalError(w, "gateway", err)
		return
	}
	writeJSON(w, http.StatusOK, s)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		internalError(w, "encoding", err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}

// writeProblem answers with an RFC 9457 problem details object.
func writeProblem(w http.ResponseWriter, status int, name, title, detail string) {
	body, _ := json.Marshal(struct { // strings and an int: cannot fail
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"https://payments.example/problems/" + name, title, status, detail})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func internalError(w http.ResponseWriter, what string, err error) {
	log.Printf("%s: %v", what, err)
	writeProblem(w, http.StatusInternalServerError, "internal", "Internal error", "The request could not be served.")
}
