// The routing plan and the gathered sums of the collectives' transports on CPU,
// compiled: each function below is one call where its torch reference is tens of
// small operations (dispatch/kernels/plan_cpu.py loads it; tests/test_plan_cpu.py holds
// each to its reference, bitwise).
//
//   route       plan.route_reference
//   route_row   plan_graph.route_phase_reference, one group: the route and the row
//               each rank all-gathers (value checks folded into its failed entry)
//   counts_row  counts.exchange's route and the row it all-gathers (value checks folded
//               into its failed entry), and the routing rows the all-gather and
//               hierarchical variants move
//   send_order  plan.send_positions, then plan.items_by_row and plan.rows_by_item
//   forward_order  transports.hierarchical.forward_order_reference (its second stage's send order)
//   tier_plan   transports.hierarchical.tier_plan_reference (its host plan from the counts)
//   expand      counts.expand_reference (the all-gather and hierarchical variants'
//               expansion of the routing rows that reached a rank to canonical order)
//   send_plan   plan_graph.send_phase, one group: the send plan, the summary the
//               host reads and the receive table
//   recv_plan   plan.build_recv_plan_reference
//   gather_sum  kernels.gather_sum.gather_sum_reference
//
// Notation as in dispatch/plan.py: T tokens, K slots, W ranks, L local experts,
// E = W L experts, J = min(K, L) slots a send row carries.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// The weights as their wire dtype's 32-bit words (fp32: one; fp64: two), row-major.
Tensor weight_words(const Tensor& weights) {
  const auto wire = weights.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return weights.to(wire).reshape({-1}).contiguous().view(at::kInt);  // (reshaped: an empty one's strides may be 0)
}

bool all_finite(const Tensor& weights) {
  const Tensor w = weights.contiguous();
  bool finite = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "all_finite", [&] {
    const scalar_t* p = w.data_ptr<scalar_t>();
    for (int64_t i = 0; i < w.numel() && finite; ++i) finite = std::isfinite(static_cast<double>(p[i]));
  });
  return finite;
}

// The route of one rank's ids [T, K] into dest [T, K] (W for a slot not routed),
// hits [T, W] and counts [W, 1 + L] (zeroed by the caller): a slot is routed where
// its id is in [0, E) and no earlier slot of its token names it. Returns whether
// an id is bad: outside [-1, E), or an id >= 0 twice in a token.
bool route_into(const int64_t* id, int64_t tokens, int64_t topk, int64_t num_experts, int64_t world, int64_t* to,
                bool* hits, int64_t* counts) {
  const int64_t local = num_experts / world;
  bool bad = false;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t* slots = id + t * topk;
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t v = slots[k];
      bool repeat = false;
      for (int64_t j = 0; j < k && !repeat; ++j) repeat = slots[j] == v;
      bad |= v < -1 || v >= num_experts || (repeat && v >= 0);
      if (v < 0 || v >= num_experts || repeat) {
        to[t * topk + k] = world;
        continue;
      }
      const int64_t d = v / local;
      to[t * topk + k] = d;
      if (!hits[t * world + d]) {
        hits[t * world + d] = true;
        counts[d * (1 + local)] += 1;
      }
      counts[d * (1 + local) + 1 + (v - d * local)] += 1;
    }
  }
  return bad;
}

// (dest [T, K] int64, hit [T, W] bool, counts [W, 1 + L] int64): plan.Route.
std::vector<Tensor> route(const Tensor& topk_idx, int64_t num_experts, int64_t world) {
  TORCH_CHECK(topk_idx.dim() == 2 && world > 0 && num_experts >= world,
              "route: arguments of other shapes than a dispatch's");
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t tokens = idx.size(0), topk = idx.size(1), local = num_experts / world;
  Tensor dest = at::empty({tokens, topk}, idx.options());
  Tensor hit = at::zeros({tokens, world}, idx.options().dtype(at::kBool));
  Tensor counts = at::zeros({world, 1 + local}, idx.options());
  route_into(idx.data_ptr<int64_t>(), tokens, topk, num_experts, world, dest.data_ptr<int64_t>(),
             hit.data_ptr<bool>(), counts.data_ptr<int64_t>());
  return {dest, hit, counts};
}

// (dest [T, K] int64, hit [T, W] bool, row [W (1 + L) + header + W 2 L + 1] int64):
// the route, and the row: its counts, the header, then one group's tail. With
// check_values, a bad value (route) raises the row's failed entry.
std::tuple<Tensor, Tensor, Tensor> route_row(const Tensor& topk_idx, const Tensor& weights, const Tensor& header,
                                             int64_t num_experts, int64_t world, bool check_values,
                                             int64_t failed_col) {
  TORCH_CHECK(topk_idx.dim() == 2 && weights.numel() == topk_idx.numel() && header.scalar_type() == at::kLong &&
                  0 <= failed_col && failed_col < header.numel() && world > 0 && num_experts >= world,
              "route_row: arguments of other shapes than a dispatch's");
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t tokens = idx.size(0), topk = idx.size(1), local = num_experts / world;
  const int64_t header_len = header.numel(), header_at = world * (1 + local);
  Tensor dest = at::empty({tokens, topk}, idx.options());
  Tensor hit = at::zeros({tokens, world}, idx.options().dtype(at::kBool));
  Tensor row = at::zeros({header_at + header_len + world * 2 * local + 1}, idx.options());
  int64_t* out = row.data_ptr<int64_t>();
  const bool bad = route_into(idx.data_ptr<int64_t>(), tokens, topk, num_experts, world, dest.data_ptr<int64_t>(),
                              hit.data_ptr<bool>(), out);
  const Tensor head = header.contiguous();
  std::copy(head.data_ptr<int64_t>(), head.data_ptr<int64_t>() + header_len, out + header_at);
  if (check_values && (bad || !all_finite(weights)))
    out[header_at + failed_col] = std::max<int64_t>(out[header_at + failed_col], 1);
  out[row.numel() - 1] = 1;  // G: one group
  return {dest, hit, row};
}

// (dest [T, K] int64, hit [T, W] bool, node_hit [T, M] bool, row [W (1 + L) + header + 1 + M + 1] int64,
// routing [T, 2 + 2 K] int64 or an empty tensor) of counts.exchange: the route, whether each token
// has an expert on each node of local ranks, the row it all-gathers: the counts, the header
// (header_and_tail's first entries), T, the tokens with an expert on each node, then G (its last
// entry); and with_routing, each token's routing row (counts.ROUTING: this rank, the token, its
// ids, its weights' fp64 bits). With check_values, a bad value (route) raises the header's
// failed entry.
std::vector<Tensor> counts_row(const Tensor& topk_idx, const Tensor& weights, bool check_values,
                               const std::vector<int64_t>& header_and_tail, int64_t num_experts, int64_t world,
                               int64_t local_ranks, int64_t failed_col, int64_t rank, bool with_routing) {
  const int64_t header_len = static_cast<int64_t>(header_and_tail.size()) - 2;  // its tail: T, G
  TORCH_CHECK(topk_idx.dim() == 2 && world > 0 && num_experts >= world && local_ranks > 0 &&
                  world % local_ranks == 0 && 0 <= failed_col && failed_col < header_len &&
                  header_and_tail[header_len] == topk_idx.size(0) && weights.numel() == topk_idx.numel() &&
                  0 <= rank && rank < world,
              "counts_row: arguments of other shapes than a dispatch's");
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t tokens = idx.size(0), topk = idx.size(1), local = num_experts / world, nodes = world / local_ranks;
  const int64_t header_at = world * (1 + local);
  Tensor dest = at::empty({tokens, topk}, idx.options());
  Tensor hit = at::zeros({tokens, world}, idx.options().dtype(at::kBool));
  Tensor node_hit = at::zeros({tokens, nodes}, idx.options().dtype(at::kBool));
  Tensor row = at::zeros({header_at + header_len + 2 + nodes}, idx.options());
  int64_t* out = row.data_ptr<int64_t>();
  const bool bad = route_into(idx.data_ptr<int64_t>(), tokens, topk, num_experts, world, dest.data_ptr<int64_t>(),
                              hit.data_ptr<bool>(), out);
  std::copy(header_and_tail.begin(), header_and_tail.begin() + header_len, out + header_at);
  if (check_values && (bad || !all_finite(weights)))
    out[header_at + failed_col] = std::max<int64_t>(out[header_at + failed_col], 1);
  int64_t* tail = out + header_at + header_len;
  tail[0] = tokens;
  tail[1 + nodes] = header_and_tail[header_len + 1];
  const bool* hits = hit.data_ptr<bool>();
  bool* on_node = node_hit.data_ptr<bool>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t n = 0; n < nodes; ++n) {
      bool any = false;
      for (int64_t l = 0; l < local_ranks && !any; ++l) any = hits[t * world + n * local_ranks + l];
      on_node[t * nodes + n] = any;
      tail[1 + n] += any;
    }
  Tensor routing = at::empty({with_routing ? tokens : 0, 2 + 2 * topk}, idx.options());
  if (with_routing) {
    const Tensor w = weights.to(at::kDouble).contiguous().view(at::kLong);
    const int64_t *id = idx.data_ptr<int64_t>(), *bits = w.data_ptr<int64_t>();
    int64_t* r = routing.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t, r += 2 + 2 * topk) {
      r[0] = rank;
      r[1] = t;
      std::copy(id + t * topk, id + (t + 1) * topk, r + 2);
      std::copy(bits + t * topk, bits + (t + 1) * topk, r + 2 + topk);
    }
  }
  return {dest, hit, node_hit, row, routing};
}

// (items_by_row [S], rows_by_item [I, D]) of items going out destination-major, then
// item: the row of each (item, destination) is the items up to it going there, after
// the rows of the destinations before (sizes, S = their sum); row i of rows_by_item
// lists item i's rows ascending, -1 padded. Rows no item takes are -1.
std::vector<Tensor> send_order(const Tensor& hit_in, const std::vector<int64_t>& sizes) {
  const Tensor hit = hit_in.contiguous();
  TORCH_CHECK(hit.dim() == 2 && hit.scalar_type() == at::kBool && static_cast<int64_t>(sizes.size()) == hit.size(1),
              "send_order: arguments of other shapes than a plan's");
  const int64_t items = hit.size(0), dests = hit.size(1);
  std::vector<int64_t> next(dests);
  int64_t rows = 0;
  for (int64_t d = 0; d < dests; ++d) {
    next[d] = rows;
    rows += sizes[d];
  }
  const auto i64 = hit.options().dtype(at::kLong);
  Tensor items_by_row = at::full({rows}, -1, i64), rows_by_item = at::full({items, dests}, -1, i64);
  const bool* h = hit.data_ptr<bool>();
  int64_t *item_of = items_by_row.data_ptr<int64_t>(), *row_of = rows_by_item.data_ptr<int64_t>();
  for (int64_t i = 0; i < items; ++i) {
    int64_t* mine = row_of + i * dests;
    int64_t n = 0;
    for (int64_t d = 0; d < dests; ++d) {
      if (!h[i * dests + d]) continue;
      const int64_t r = next[d]++;
      if (r < rows) item_of[r] = i;
      mine[n++] = r;
    }
    std::sort(mine, mine + n);
  }
  return {items_by_row, rows_by_item};
}

// The route (as route routes them) of routing rows [I, 2 + 2 K] int64 (counts.ROUTING): each
// row's ids, each slot's rank (W: none), whether each row has a slot on each rank, and the
// counts [W, 1 + L].
struct RowsRoute {
  std::vector<int64_t> ids, to, counts;
  std::vector<char> hits;
};

RowsRoute route_rows(const Tensor& routing, int64_t topk, int64_t num_experts, int64_t world) {
  const int64_t items = routing.size(0), cols = 2 + 2 * topk, local = num_experts / world;
  RowsRoute r{std::vector<int64_t>(items * topk), std::vector<int64_t>(items * topk),
              std::vector<int64_t>(world * (1 + local), 0), std::vector<char>(items * world, 0)};
  const int64_t* row = routing.data_ptr<int64_t>();
  for (int64_t i = 0; i < items; ++i) std::copy(row + i * cols + 2, row + i * cols + 2 + topk, r.ids.data() + i * topk);
  route_into(r.ids.data(), items, topk, num_experts, world, r.to.data(), reinterpret_cast<bool*>(r.hits.data()),
             r.counts.data());
  return r;
}

// send_order of routing rows [I, 2 + 2 K] (counts.ROUTING) to the D = sizes.size() ranks
// first .. first + D - 1 that hold one of their experts (routed as route routes them),
// then the rows in that order: the hierarchical variant's second stage, inside a node.
std::vector<Tensor> forward_order(const Tensor& routing_in, int64_t topk, int64_t num_experts, int64_t world,
                                  int64_t first, const std::vector<int64_t>& sizes) {
  const Tensor routing = routing_in.to(at::kLong).contiguous();
  const int64_t dests = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(routing.dim() == 2 && routing.size(1) == 2 + 2 * topk && world > 0 && num_experts >= world &&
                  0 <= first && first + dests <= world,
              "forward_order: arguments of other shapes than a plan's");
  const int64_t items = routing.size(0);
  const RowsRoute r = route_rows(routing, topk, num_experts, world);
  Tensor hit = at::empty({items, dests}, routing.options().dtype(at::kBool));
  bool* h = hit.data_ptr<bool>();
  for (int64_t i = 0; i < items; ++i)
    for (int64_t d = 0; d < dests; ++d) h[i * dests + d] = r.hits[i * world + first + d];
  std::vector<Tensor> order = send_order(hit, sizes);
  order.push_back(routing_in.index_select(0, order[0]));
  return order;
}

// The hierarchical variant's host plan from the all-gathered counts [W, W, 1 + L] (source, destination:
// plan.Route.counts), node hits [W, M] (counts.GlobalCounts.node_hits), tokens [W], and this rank's
// tokens' nodes node_hit [T, M] bool and routing rows [T, 2 + 2 K], for this rank (node a, index l of
// ranks_per_node): (send1 [M], recv1 [M]) the stage-1 rows to and from each node's rank of index l,
// (send2, recv2) [ranks_per_node] the stage-2 rows to and from each rank of node a, per_expert [L] the
// slots of this rank's local experts, stage 1's send order (send_order of node_hit) and its routing rows
// in that order, then (the offsets of this rank's own block in stage 1's send and held rows, the rows
// that arrive in stage 2, the largest T or 1).
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, Tensor, Tensor,
           Tensor, Tensor, std::vector<int64_t>>
tier_plan(const Tensor& counts_in, const Tensor& node_hits_in, const Tensor& tokens_in, const Tensor& node_hit,
          const Tensor& routing, int64_t rank, int64_t ranks_per_node) {
  const Tensor counts = counts_in.contiguous(), node_hits = node_hits_in.contiguous();
  const Tensor tokens = tokens_in.contiguous();
  TORCH_CHECK(counts.dim() == 3 && node_hits.dim() == 2, "tier_plan: arguments of other shapes than a plan's");
  const int64_t world = counts.size(0), width = counts.size(2), nodes = node_hits.size(1);
  TORCH_CHECK(counts.size(1) == world && width >= 1 && counts.scalar_type() == at::kLong &&
                  ranks_per_node > 0 && nodes * ranks_per_node == world && node_hits.size(0) == world &&
                  node_hits.scalar_type() == at::kLong && tokens.numel() == world &&
                  tokens.scalar_type() == at::kLong && 0 <= rank && rank < world,
              "tier_plan: arguments of other shapes than a plan's");
  const int64_t* c = counts.data_ptr<int64_t>();
  const int64_t* nh = node_hits.data_ptr<int64_t>();
  const int64_t node = rank / ranks_per_node, index = rank % ranks_per_node;
  auto hits = [&](int64_t src, int64_t dst) { return c[(src * world + dst) * width]; };
  std::vector<int64_t> send1(nodes), recv1(nodes), send2(ranks_per_node, 0), recv2(ranks_per_node, 0);
  int64_t self_send = 0, self_recv = 0;
  for (int64_t b = 0; b < nodes; ++b) {
    const int64_t holder_source = b * ranks_per_node + index;  // a source whose tokens this rank holds
    send1[b] = nh[rank * nodes + b];
    recv1[b] = nh[holder_source * nodes + node];
    if (b < node) {
      self_send += send1[b];
      self_recv += recv1[b];
    }
    for (int64_t i = 0; i < ranks_per_node; ++i) {
      send2[i] += hits(holder_source, node * ranks_per_node + i);
      recv2[i] += hits(b * ranks_per_node + i, rank);
    }
  }
  Tensor per_expert = at::zeros({width - 1}, counts.options());
  int64_t* pe = per_expert.data_ptr<int64_t>();
  for (int64_t s = 0; s < world; ++s)
    for (int64_t e = 1; e < width; ++e) pe[e - 1] += c[(s * world + rank) * width + e];
  int64_t arrive = 0, block = 1;
  for (const int64_t r : recv2) arrive += r;
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t s = 0; s < world; ++s) block = std::max(block, t[s]);
  const std::vector<Tensor> order = send_order(node_hit, send1);
  return {send1, recv1, send2, recv2, per_expert, order[0], order[1], routing.index_select(0, order[0]),
          {self_send, self_recv, arrive, block}};
}

// (slots [N], here [R], presum_index [R, J], expand_src [N], weights [N] fp64, src_rank [N],
// src_token [N]: counts.Expansion) of the routing rows that reached this rank (routing [I, 2 + 2 K]: each
// item's source rank s and token t, ids and weights' fp64 bits, counts.ROUTING; order key
// s block + t, unique among the items with a slot here, in [0, W block)): the slots whose
// expert lives on this rank (routed as route routes them), as item K + k in canonical order
// (local expert, then order key); the items with a slot here, ascending, and each one's
// expanded rows in ascending local expert, -1 padded (J = width); then each expanded row's
// item, weight, source rank and token. N must be num_rows and R items_here (the counts say so).
std::vector<Tensor> expand(const Tensor& routing_in, int64_t topk, int64_t block, int64_t num_experts,
                           int64_t world, int64_t rank, int64_t num_rows, int64_t width, int64_t items_here) {
  const Tensor routing = routing_in.to(at::kLong).contiguous();
  TORCH_CHECK(routing.dim() == 2 && routing.size(1) == 2 + 2 * topk && world > 0 && num_experts >= world &&
                  0 <= rank && rank < world && width >= 0 && block >= 0,
              "expand: arguments of other shapes than a plan's");
  const int64_t items = routing.size(0), cols = 2 + 2 * topk, local = num_experts / world;
  const RowsRoute r = route_rows(routing, topk, num_experts, world);
  const std::vector<int64_t>& to = r.to;
  const std::vector<int64_t>& counts = r.counts;
  const std::vector<char>& hits = r.hits;
  const int64_t* row = routing.data_ptr<int64_t>();
  const int64_t* id = r.ids.data();
  // the items with a slot here, in ascending key
  std::vector<int64_t> by_key, key(items, 0);
  for (int64_t i = 0; i < items; ++i) {
    if (!hits[i * world + rank]) continue;
    key[i] = row[i * cols] * block + row[i * cols + 1];
    TORCH_CHECK(0 <= key[i] && key[i] < world * block, "expand: an order key outside [0, W block)");
    by_key.push_back(i);
  }
  TORCH_CHECK(static_cast<int64_t>(by_key.size()) == items_here, "expand: the items here disagree with the counts");
  std::sort(by_key.begin(), by_key.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  // each local expert's first row, then the rows in key order within it
  std::vector<int64_t> next(local + 1, 0);
  for (int64_t e = 0; e < local; ++e) next[e + 1] = next[e] + counts[rank * (1 + local) + 1 + e];
  TORCH_CHECK(next[local] == num_rows, "expand: the slots here disagree with the counts");
  std::vector<int64_t> place(items, -1);  // each item here's place among them (ascending item)
  for (int64_t i = 0, at = 0; i < items; ++i)
    if (hits[i * world + rank]) place[i] = at++;
  const auto i64 = routing.options();
  Tensor slots = at::empty({num_rows}, i64), presum = at::full({items_here, width}, -1, i64);
  Tensor here = at::empty({items_here}, i64), expand_src = at::empty({num_rows}, i64);
  Tensor weights = at::empty({num_rows}, i64.dtype(at::kDouble)), src_rank = at::empty({num_rows}, i64);
  Tensor src_token = at::empty({num_rows}, i64);
  int64_t *slot_of = slots.data_ptr<int64_t>(), *pre = presum.data_ptr<int64_t>();
  int64_t *src = expand_src.data_ptr<int64_t>(), *s_rank = src_rank.data_ptr<int64_t>();
  int64_t *s_token = src_token.data_ptr<int64_t>(), *weight_bits = weights.view(at::kLong).data_ptr<int64_t>();
  int64_t* item_here = here.data_ptr<int64_t>();
  for (const int64_t i : by_key) {
    item_here[place[i]] = i;
    for (int64_t k = 0; k < topk; ++k) {
      if (to[i * topk + k] != rank) continue;
      const int64_t e = id[i * topk + k] - rank * local;
      int64_t col = 0;  // the item's slots here of smaller local expert
      for (int64_t j = 0; j < topk; ++j) col += to[i * topk + j] == rank && id[i * topk + j] < id[i * topk + k];
      const int64_t r = next[e]++;
      slot_of[r] = i * topk + k;
      src[r] = i;
      weight_bits[r] = row[i * cols + 2 + topk + k];
      s_rank[r] = row[i * cols];
      s_token[r] = row[i * cols + 1];
      if (col < width) pre[place[i] * width + col] = r;
    }
  }
  return {slots, here, presum, expand_src, weights, src_rank, src_token};
}

// (send_token [C], meta [C + 1, J + 1 + J w], home_index [T, W], slot_row [T, K],
// slot_col [T, K], summary, table [3, W]) with C = T min(K, W), from this rank's
// route and the all-gathered rows [W, row width]: plan.SendPlan, then
// plan_graph.plan_summary and plan.one_group_table. Rows past the S sent are -1.
std::vector<Tensor> send_plan(const Tensor& dest_in, const Tensor& hit_in, const Tensor& gathered_in, int64_t rank,
                              const Tensor& topk_idx, const Tensor& weights, int64_t header_len) {
  const Tensor dest = dest_in.contiguous(), hit = hit_in.contiguous(), gathered = gathered_in.contiguous();
  const Tensor idx = topk_idx.to(at::kLong).contiguous();
  const int64_t tokens = hit.size(0), world = hit.size(1), topk = dest.size(1);
  const int64_t width_row = gathered.size(1);
  TORCH_CHECK(dest.size(0) == tokens && idx.sizes() == dest.sizes() && weights.numel() == dest.numel() &&
                  gathered.size(0) == world && 0 <= rank && rank < world,
              "send_plan: arguments of other shapes than a dispatch's");
  const int64_t local = (width_row - header_len - 1 - world) / (3 * world);  // row: W (1 + L) + header + 2 W L + 1
  TORCH_CHECK(world * (3 * local + 1) + header_len + 1 == width_row, "send_plan: gathered rows of a bad width");
  const int64_t header_at = world * (1 + local), tail_at = header_at + header_len;
  const int64_t width = std::min(topk, local), capacity = tokens * std::min(topk, world);
  const Tensor words_of = weight_words(weights);
  const int64_t words = weights.scalar_type() == at::kDouble ? 2 : 1;
  const auto i64 = idx.options();
  const int64_t* g = gathered.data_ptr<int64_t>();
  auto count = [&](int64_t s, int64_t d, int64_t c) { return g[s * width_row + d * (1 + local) + c]; };

  // send rows: destination-major, then token
  std::vector<int64_t> next(world), end(world);
  for (int64_t d = 0, at = 0; d < world; ++d) {
    next[d] = at;
    end[d] = at += count(rank, d, 0);
  }
  Tensor send_token = at::full({capacity}, -1, i64);
  Tensor home_index = at::full({tokens, world}, -1, i64);
  Tensor meta = at::full({capacity + 1, width + 1 + width * words}, -1, i64.dtype(at::kInt));
  const bool* hits = hit.data_ptr<bool>();
  int64_t* token_of = send_token.data_ptr<int64_t>();
  int64_t* home = home_index.data_ptr<int64_t>();
  int32_t* m = meta.data_ptr<int32_t>();
  const int64_t meta_width = meta.size(1);
  std::vector<int64_t> row_of(tokens * world, -1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t d = 0, n = 0; d < world; ++d) {
      if (!hits[t * world + d]) continue;
      const int64_t r = next[d]++;
      TORCH_CHECK(r < end[d], "send_plan: this rank's row disagrees with its route");
      row_of[t * world + d] = r;
      token_of[r] = t;
      home[t * world + n++] = r;
      m[r * meta_width + width] = static_cast<int32_t>(t);
    }
  }
  // each expert's first expanded row from this rank on its rank (expert-major,
  // then source rank, then token)
  std::vector<int64_t> start(world * local);
  for (int64_t d = 0; d < world; ++d) {
    for (int64_t e = 0, before = 0; e < local; ++e) {
      int64_t earlier_ranks = 0, all = 0;
      for (int64_t s = 0; s < world; ++s) {
        all += count(s, d, 1 + e);
        if (s < rank) earlier_ranks += count(s, d, 1 + e);
      }
      start[d * local + e] = before + earlier_ranks;
      before += all;
    }
  }
  Tensor slot_row = at::full({tokens, topk}, -1, i64), slot_col = at::full({tokens, topk}, -1, i64);
  int64_t* srow = slot_row.data_ptr<int64_t>();
  int64_t* scol = slot_col.data_ptr<int64_t>();
  const int64_t* id = idx.data_ptr<int64_t>();
  const int64_t* to = dest.data_ptr<int64_t>();
  const int32_t* w = words_of.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t at = t * topk + k, d = to[at];
      if (d >= world) continue;
      int64_t col = 0;
      for (int64_t j = 0; j < topk; ++j) col += to[t * topk + j] == d && id[t * topk + j] < id[at];
      const int64_t r = row_of[t * world + d];
      srow[at] = r;
      scol[at] = col;
      int32_t* line = m + r * meta_width;
      line[col] = static_cast<int32_t>(start[id[at]]++);
      for (int64_t word = 0; word < words; ++word) line[width + 1 + col * words + word] = w[at * words + word];
    }
  }
  // the summary (plan_graph.plan_summary) and the receive table of one group
  const int64_t tail_width = 2 * world * local;
  Tensor summary = at::empty(
      {2 * world + local + world * header_len + world * world + world + 2 * tail_width + world + world}, i64);
  int64_t* sum = summary.data_ptr<int64_t>();
  for (int64_t d = 0; d < world; ++d) *sum++ = count(rank, d, 0);
  for (int64_t s = 0; s < world; ++s) *sum++ = count(s, rank, 0);
  for (int64_t e = 0; e < local; ++e) {
    int64_t all = 0;
    for (int64_t s = 0; s < world; ++s) all += count(s, rank, 1 + e);
    *sum++ = all;
  }
  for (int64_t s = 0; s < world; ++s) sum = std::copy(g + s * width_row + header_at, g + s * width_row + tail_at, sum);
  for (int64_t s = 0; s < world; ++s)
    for (int64_t d = 0; d < world; ++d) *sum++ = count(s, d, 0);
  for (int64_t d = 0; d < world; ++d) {
    int64_t all = 0;
    for (int64_t s = 0; s < world; ++s)
      for (int64_t e = 0; e < local; ++e) all += count(s, d, 1 + e);
    *sum++ = all;
  }
  const int64_t* tail = g + rank * width_row + tail_at;
  sum = std::copy(tail, tail + tail_width, sum);
  for (int64_t s = 0; s < world; ++s) {
    const int64_t* theirs = g + s * width_row + tail_at + rank * 2 * local;
    sum = std::copy(theirs, theirs + 2 * local, sum);
  }
  for (int64_t s = 0; s < world; ++s) *sum++ = g[s * width_row + tail_at + tail_width];
  // every rank's rows in its fullest group of local experts, by this rank's G (plan.expert_groups)
  const int64_t spread = std::max<int64_t>(local, 1);
  const int64_t own = std::min(std::max<int64_t>(g[rank * width_row + tail_at + tail_width], 1), spread);
  std::vector<int64_t> by(spread);
  for (int64_t d = 0; d < world; ++d) {
    std::fill(by.begin(), by.end(), 0);
    for (int64_t e = 0; e < local; ++e)
      for (int64_t s = 0; s < world; ++s) by[((e + 1) * own - 1) / spread] += count(s, d, 1 + e);
    *sum++ = *std::max_element(by.begin(), by.end());
  }
  Tensor table = at::empty({3, world}, i64);
  int64_t* tab = table.data_ptr<int64_t>();
  for (int64_t s = 0, at = 0; s < world; ++s) {
    tab[s] = tab[world + s] = at;
    tab[2 * world + s] = s;
    at += count(s, rank, 0);
  }
  return {send_token, meta, home_index, slot_row, slot_col, summary, table};
}

// plan.RecvPlan: (expand_src [N], presum_index [R, J], weights [N], src_token [R],
// src_rank [R], expanded_token [N], expanded_rank [N]) from the received slot lists
// meta [R, J + 1 + J w] int32 and the table [3, B] int64 of plan.recv_table.
std::vector<Tensor> recv_plan(const Tensor& meta_in, const Tensor& table_in, int64_t num_rows, int64_t words) {
  const Tensor meta = meta_in.contiguous(), table = table_in.contiguous();
  const int64_t received = meta.size(0), blocks = table.size(1);
  TORCH_CHECK(meta.scalar_type() == at::kInt && table.scalar_type() == at::kLong && table.size(0) == 3 &&
                  (words == 1 || words == 2),
              "recv_plan: arguments of other forms than a plan's");
  const int64_t width = (meta.size(1) - 1) / (1 + words), meta_width = meta.size(1);
  const auto i64 = meta.options().dtype(at::kLong);
  Tensor expand_src = at::empty({num_rows}, i64), presum_index = at::empty({received, width}, i64);
  Tensor src_token = at::empty({received}, i64), src_rank = at::empty({received}, i64);
  Tensor expanded_token = at::empty({num_rows}, i64), expanded_rank = at::empty({num_rows}, i64);
  Tensor weight_words = at::empty({num_rows, words}, meta.options());
  const int32_t* m = meta.data_ptr<int32_t>();
  const int64_t* arrival = table.data_ptr<int64_t>();
  const int64_t *held_start = arrival + blocks, *rank_of = arrival + 2 * blocks;
  int64_t *src = expand_src.data_ptr<int64_t>(), *presum = presum_index.data_ptr<int64_t>();
  int64_t *token_of = src_token.data_ptr<int64_t>(), *from = src_rank.data_ptr<int64_t>();
  int64_t *exp_token = expanded_token.data_ptr<int64_t>(), *exp_rank = expanded_rank.data_ptr<int64_t>();
  int32_t* ww = weight_words.data_ptr<int32_t>();
  for (int64_t b = 0; b < blocks; ++b) {  // a block's rows: from its start to the next block's
    const int64_t end = b + 1 < blocks ? arrival[b + 1] : received;
    for (int64_t r = arrival[b]; r < end; ++r) {
      const int64_t held = held_start[b] + r - arrival[b];
      TORCH_CHECK(held >= 0 && held < received, "recv_plan: a table that places a row outside the rows");
      const int32_t* line = m + r * meta_width;
      const int64_t token = line[width];
      token_of[held] = token;
      from[held] = rank_of[b];
      for (int64_t j = 0; j < width; ++j) {
        const int64_t slot = line[j];
        presum[held * width + j] = slot;
        if (slot < 0) continue;
        TORCH_CHECK(slot < num_rows, "recv_plan: a slot past the expanded rows");
        src[slot] = held;
        exp_token[slot] = token;
        exp_rank[slot] = rank_of[b];
        for (int64_t word = 0; word < words; ++word) ww[slot * words + word] = line[width + 1 + j * words + word];
      }
    }
  }
  const Tensor weights = weight_words.view(words == 2 ? at::kDouble : at::kFloat).view({num_rows});
  return {expand_src, presum_index, weights, src_token, src_rank, expanded_token, expanded_rank};
}

template <typename acc_t, typename src_t>
void gather_rows(const Tensor& src, const Tensor& index, const acc_t* weight, Tensor& acc) {
  const int64_t rows = index.size(0), width = index.size(1), hidden = src.size(1);
  const src_t* s = src.data_ptr<src_t>();
  const int64_t* ix = index.data_ptr<int64_t>();
  acc_t* out = acc.data_ptr<acc_t>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      acc_t* o = out + r * hidden;
      for (int64_t j = 0; j < width; ++j) {  // in j order, one rounding per product and per sum
        const int64_t i = ix[r * width + j];
        if (i < 0) continue;
        TORCH_CHECK(i < src.size(0), "gather_sum: an index past the rows");
        const src_t* row = s + i * hidden;
        if (weight != nullptr) {
          const acc_t wi = weight[i];
          for (int64_t h = 0; h < hidden; ++h) {
            const acc_t term = static_cast<acc_t>(row[h]) * wi;
            o[h] = o[h] + term;
          }
        } else {
          for (int64_t h = 0; h < hidden; ++h) o[h] = o[h] + static_cast<acc_t>(row[h]);
        }
      }
    }
  });
}

// out[r] = cast(sum over j of weight[index[r, j]] * src[index[r, j]]), summed in j
// order in fp32 (fp64 where src, weight, out_dtype or at_least_fp64 says fp64),
// products and sums each rounded once, cast once to out_dtype; index -1 = none.
Tensor gather_sum(const Tensor& src_in, const Tensor& index_in, const c10::optional<Tensor>& weight_in,
                  at::ScalarType out_dtype, bool at_least_fp64) {
  const bool acc_fp64 = at_least_fp64 || out_dtype == at::kDouble || src_in.scalar_type() == at::kDouble ||
                        (weight_in.has_value() && weight_in->scalar_type() == at::kDouble);
  const auto acc_dtype = acc_fp64 ? at::kDouble : at::kFloat;
  const Tensor index = index_in.contiguous();
  Tensor acc = at::zeros({index.size(0), src_in.size(1)}, src_in.options().dtype(acc_dtype));
  if (src_in.size(0) == 0) return acc.to(out_dtype);  // then every index is -1
  TORCH_CHECK(index.scalar_type() == at::kLong && src_in.dim() == 2 &&
                  (!weight_in.has_value() || weight_in->numel() == src_in.size(0)),
              "gather_sum: arguments of other forms than a combine's");
  const Tensor src = src_in.contiguous();
  const Tensor weight = weight_in.has_value() ? weight_in->to(acc_dtype).contiguous() : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "gather_sum", [&] {
    if (acc_fp64)
      gather_rows<double, scalar_t>(src, index, weight.defined() ? weight.data_ptr<double>() : nullptr, acc);
    else
      gather_rows<float, scalar_t>(src, index, weight.defined() ? weight.data_ptr<float>() : nullptr, acc);
  });
  return acc.to(out_dtype);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("route", &route);
  m.def("route_row", &route_row);
  m.def("counts_row", &counts_row);
  m.def("send_order", &send_order);
  m.def("forward_order", &forward_order);
  m.def("tier_plan", &tier_plan);
  m.def("expand", &expand);
  m.def("send_plan", &send_plan);
  m.def("recv_plan", &recv_plan);
  m.def("gather_sum", &gather_sum);
}
