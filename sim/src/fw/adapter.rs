//! QUERY_ADAPTER: the adapter's identity (`query_adapter_param_block`). Linux reads its `vsd_contd_psid` as the
//! board id at probe (`mlx5_query_board_id`) and fails the probe when the command fails.

use mlx5_core::prm::{ifc, MsgBuf};

use super::reply::CmdErr;

/// The IEEE OUI of Mellanox (00:02:c9), as firmware reports it.
pub(crate) const IEEE_VENDOR_ID: u32 = 0x0002c9;
/// The PCI vendor id the vendor-specific data belongs to.
pub(crate) const VSD_VENDOR_ID: u32 = 0x15b3;
/// The board's PSID (parameter-set id, `MT_` and ten digits, NUL padded to 16 bytes): the one ConnectX-5
/// MCX556A-ECAT boards carry.
pub(crate) const PSID: &[u8; 16] = b"MT_0000000008\0\0\0";

pub(super) fn query_adapter(out: &mut [u8]) -> Result<(), CmdErr> {
    use ifc::query_adapter_param_block as p;
    let blk = ifc::query_adapter_out::QUERY_ADAPTER_STRUCT;
    out.set(p::IEEE_VENDOR_ID.at(blk), IEEE_VENDOR_ID);
    out.set(p::VSD_VENDOR_ID.at(blk), VSD_VENDOR_ID);
    out.write_bytes(p::VSD_CONTD_PSID.at(blk).byte_off(), PSID);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::submit::Harness;
    use mlx5_core::prm::consts;

    #[test]
    fn query_adapter_reports_the_psid_linux_takes_as_board_id() {
        // Linux's probe fails with "query board id failed" when QUERY_ADAPTER is refused (main.c,
        // mlx5_query_board_id); it was the first command the real driver sent that the simulator lacked.
        let mut h = Harness::inline();
        h.bring_up();
        let (inlen, outlen) = (ifc::query_adapter_in::SIZE_BYTES, ifc::query_adapter_out::SIZE_BYTES);
        let (status, syndrome, out) = h.simple(consts::MLX5_CMD_OP_QUERY_ADAPTER, 0, inlen, outlen);
        assert_eq!((status, syndrome), (0, 0));
        let blk = ifc::query_adapter_out::QUERY_ADAPTER_STRUCT;
        let psid = ifc::query_adapter_param_block::VSD_CONTD_PSID.at(blk).byte_off();
        assert_eq!(&out[psid..psid + 16], PSID);
        assert_eq!(MsgBuf::get(&out[..], ifc::query_adapter_param_block::VSD_VENDOR_ID.at(blk)), 0x15b3);
        assert_eq!(MsgBuf::get(&out[..], ifc::query_adapter_param_block::IEEE_VENDOR_ID.at(blk)), 0x0002c9);
    }
}
