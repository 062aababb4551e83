/* See shim.h. Each function is a one-line wrapper: no logic lives here
 * except the rte_flow rule, which is plain C struct plumbing. */
#include <rte_errno.h>
#include <rte_lcore.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_ring.h>
#include <rte_flow.h>
#include <rte_byteorder.h>
#include <string.h>

#include "shim.h"

uint16_t phub_rx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n)
{
	return rte_eth_rx_burst(port, queue, pkts, n);
}

uint16_t phub_tx_burst(uint16_t port, uint16_t queue, struct rte_mbuf **pkts, uint16_t n)
{
	return rte_eth_tx_burst(port, queue, pkts, n);
}

struct rte_mbuf *phub_pktmbuf_alloc(struct rte_mempool *mp) { return rte_pktmbuf_alloc(mp); }

int phub_pktmbuf_alloc_bulk(struct rte_mempool *mp, struct rte_mbuf **mbufs, unsigned int n)
{
	return rte_pktmbuf_alloc_bulk(mp, mbufs, n);
}

void phub_pktmbuf_free(struct rte_mbuf *m) { rte_pktmbuf_free(m); }
void *phub_mtod(struct rte_mbuf *m) { return rte_pktmbuf_mtod(m, void *); }
char *phub_pktmbuf_append(struct rte_mbuf *m, uint16_t len) { return rte_pktmbuf_append(m, len); }
void phub_pktmbuf_attach(struct rte_mbuf *mi, struct rte_mbuf *m) { rte_pktmbuf_attach(mi, m); }
int phub_pktmbuf_chain(struct rte_mbuf *head, struct rte_mbuf *tail) { return rte_pktmbuf_chain(head, tail); }
uint16_t phub_mbuf_refcnt_update(struct rte_mbuf *m, int16_t v) { return rte_mbuf_refcnt_update(m, v); }
uint16_t phub_pktmbuf_tailroom(const struct rte_mbuf *m) { return rte_pktmbuf_tailroom(m); }
uint16_t phub_pktmbuf_data_room_size(struct rte_mempool *mp) { return rte_pktmbuf_data_room_size(mp); }
void phub_mbuf_tx_udp_cksum(struct rte_mbuf *m, uint16_t l2, uint16_t l3, uint16_t l4)
{
    m->ol_flags |= RTE_MBUF_F_TX_IPV4 | RTE_MBUF_F_TX_IP_CKSUM | RTE_MBUF_F_TX_UDP_CKSUM;
    m->l2_len = l2;
    m->l3_len = l3;
    m->l4_len = l4;
}

int phub_errno(void) { return rte_errno; }
unsigned int phub_lcore_id(void) { return rte_lcore_id(); }

unsigned int phub_ring_enqueue_burst(struct rte_ring *r, void *const *objs, unsigned int n)
{
	return rte_ring_enqueue_burst(r, objs, n, NULL);
}

unsigned int phub_ring_dequeue_burst(struct rte_ring *r, void **objs, unsigned int n)
{
	return rte_ring_dequeue_burst(r, objs, n, NULL);
}

unsigned int phub_ring_count(const struct rte_ring *r) { return rte_ring_count(r); }

uint64_t phub_rx_offload_ipv4_cksum(void) { return RTE_ETH_RX_OFFLOAD_IPV4_CKSUM; }
uint64_t phub_rx_offload_udp_cksum(void) { return RTE_ETH_RX_OFFLOAD_UDP_CKSUM; }
uint64_t phub_rx_offload_scatter(void) { return RTE_ETH_RX_OFFLOAD_SCATTER; }
uint64_t phub_tx_offload_multi_segs(void) { return RTE_ETH_TX_OFFLOAD_MULTI_SEGS; }
uint64_t phub_tx_offload_mbuf_fast_free(void) { return RTE_ETH_TX_OFFLOAD_MBUF_FAST_FREE; }
uint64_t phub_tx_offload_ipv4_cksum(void) { return RTE_ETH_TX_OFFLOAD_IPV4_CKSUM; }
uint64_t phub_tx_offload_udp_cksum(void) { return RTE_ETH_TX_OFFLOAD_UDP_CKSUM; }
uint64_t phub_rss_ip_udp(void) { return RTE_ETH_RSS_IP | RTE_ETH_RSS_UDP; }
uint64_t phub_rx_ip_cksum_mask(void) { return RTE_MBUF_F_RX_IP_CKSUM_MASK; }
uint64_t phub_rx_ip_cksum_bad(void) { return RTE_MBUF_F_RX_IP_CKSUM_BAD; }
uint64_t phub_rx_l4_cksum_mask(void) { return RTE_MBUF_F_RX_L4_CKSUM_MASK; }
uint64_t phub_rx_l4_cksum_bad(void) { return RTE_MBUF_F_RX_L4_CKSUM_BAD; }

int phub_flow_udp_dst_to_queue(uint16_t port, uint16_t udp_dst, uint16_t queue,
                               int validate_only, struct rte_flow **out, const char **msg)
{
	struct rte_flow_attr attr;
	struct rte_flow_item pattern[4];
	struct rte_flow_action actions[2];
	struct rte_flow_item_udp udp_spec, udp_mask;
	struct rte_flow_action_queue q;
	struct rte_flow_error err;
	int rc;

	memset(&attr, 0, sizeof(attr));
	attr.ingress = 1;
	memset(pattern, 0, sizeof(pattern));
	memset(actions, 0, sizeof(actions));
	memset(&udp_spec, 0, sizeof(udp_spec));
	memset(&udp_mask, 0, sizeof(udp_mask));
	memset(&err, 0, sizeof(err));
	udp_spec.hdr.dst_port = rte_cpu_to_be_16(udp_dst);
	udp_mask.hdr.dst_port = 0xffff;
	pattern[0].type = RTE_FLOW_ITEM_TYPE_ETH;
	pattern[1].type = RTE_FLOW_ITEM_TYPE_IPV4;
	pattern[2].type = RTE_FLOW_ITEM_TYPE_UDP;
	pattern[2].spec = &udp_spec;
	pattern[2].mask = &udp_mask;
	pattern[3].type = RTE_FLOW_ITEM_TYPE_END;
	q.index = queue;
	actions[0].type = RTE_FLOW_ACTION_TYPE_QUEUE;
	actions[0].conf = &q;
	actions[1].type = RTE_FLOW_ACTION_TYPE_END;

	*msg = NULL;
	rc = rte_flow_validate(port, &attr, pattern, actions, &err);
	if (rc == 0 && !validate_only) {
		*out = rte_flow_create(port, &attr, pattern, actions, &err);
		if (*out == NULL)
			rc = -rte_errno;
	}
	if (rc != 0)
		*msg = err.message;
	return rc;
}
